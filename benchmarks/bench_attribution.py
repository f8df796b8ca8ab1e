#!/usr/bin/env python3
"""Spike attribution: one forward-mode pass (JVP) per rank batch vs one backward pass per sample, side by side.

Both attribute the demo's spike (reference run, ratio_outliers, world size 2, 8 samples per rank)
with `attribute_spike`; both first replay the step once for g. `jvp` then runs one dual-number
forward per rank batch; `per_sample_backward` runs one backward per sample (plus one for the router
losses) on the retained graph. Runs alternate; medians of 5 after a warm-up. Contributions must agree.

Usage: .venv/bin/python benchmarks/bench_attribution.py [--runs 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from axrl_spike_replay.replay.attribution import attribute_spike
from replay_spike import capture_demo_spike, median


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory(prefix="bench-attribution-") as tmp:
        snapshot = capture_demo_spike(Path(tmp))
        times: dict[str, dict[str, list[float]]] = {m: {"attribution": [], "total": []} for m in ("jvp", "naive")}
        for method in ("jvp", "per_sample_backward"):  # warm-up (imports, allocator)
            attribute_spike(snapshot, method=method)
        for _ in range(runs):
            fast = attribute_spike(snapshot, top=100, method="jvp")
            naive = attribute_spike(snapshot, top=100, method="per_sample_backward")
            for key, result in (("jvp", fast), ("naive", naive)):
                times[key]["attribution"].append(result.timings["attribution"])
                times[key]["total"].append(result.timings["total"])
        by_sample = {(s.rank, s.sample): s.contribution for s in naive.samples}
        worst = max(abs(s.contribution - by_sample[(s.rank, s.sample)]) for s in fast.samples) / fast.grad_norm
    a_fast, a_naive = median(times["jvp"]["attribution"]), median(times["naive"]["attribution"])
    t_fast, t_naive = median(times["jvp"]["total"]), median(times["naive"]["total"])
    print(
        f"demo spike: {fast.total_samples} samples ({fast.total_samples // fast.world_size_saved} per rank), "
        f"grad norm {fast.grad_norm:.6g}, sum check {fast.sum_rel_error:.1e}, max |jvp - naive| / ||g|| {worst:.1e}"
    )
    print(
        f"per-sample part: jvp {a_fast * 1e3:7.1f} ms vs one backward per sample {a_naive * 1e3:7.1f} ms "
        f"-> {a_naive / a_fast:.1f}x faster (target >= 3x)"
    )
    print(
        f"whole call (load, replay for g, attribution): {t_fast * 1e3:7.1f} ms vs {t_naive * 1e3:7.1f} ms "
        f"-> {t_naive / t_fast:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
