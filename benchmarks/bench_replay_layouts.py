#!/usr/bin/env python3
"""Replay at the saved world size (2 gloo processes, full fidelity) vs reduced to 1 process, side by side.

Both replay the demo's spike (reference run, ratio_outliers, world size 2) with `run_replay`;
runs alternate, medians of 3. Reports both wall times and both rel_diffs against the recorded
grad norm (full: <= 1e-6 expected, reduced: <= 1e-5).

Usage: .venv/bin/python benchmarks/bench_replay_layouts.py [--runs 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from replay_spike import capture_demo_spike, median, timed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as tmp:
        snapshot = capture_demo_spike(Path(tmp))
        seconds: dict[int, list[float]] = {2: [], 1: []}
        results = {}
        for _ in range(runs):
            for nproc in (2, 1):
                elapsed, results[nproc] = timed(
                    lambda n=nproc: run_replay(replay_request(What(snapshot), how=How(nproc=n)))
                )
                seconds[nproc].append(elapsed)
    full, reduced = results[2], results[1]
    print(f"demo spike: recorded grad norm {full.recorded_grad_norm:.10g} (saved world size {full.world_size_saved})")
    for label, r, n in (("full   ", full, 2), ("reduced", reduced, 1)):
        print(
            f"{label} ({n} process(es)): {median(seconds[n]):6.2f} s  grad norm {r.grad_norm:.10g}  "
            f"rel_diff {r.rel_diff:.1e} (tolerance {r.tolerance:.0e})  -> {r.verdict}"
        )
    ratio = median(seconds[2]) / median(seconds[1])
    print(f"full takes {ratio:.0f}x the reduced time here: at this size it is mostly starting the 2 rank processes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
