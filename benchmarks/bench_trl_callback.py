#!/usr/bin/env python3
"""The TRL spike guard's per-step overhead vs the same GRPOTrainer without it, side by side in one run.

Interleaves bare and guarded runs of the tiny GRPO run (tests/capture/trl_run.py: TRL's own GRPOTrainer, a tiny
qwen3_moe, transformers generation, no burst, so nothing trips), each a fresh trainer of the same seed, in pairs
whose order alternates (A/B, B/A, ...) after one warm-up pair that is not counted, so a drift in the machine's load
falls on both sides alike. Prints the median of the pairs' guarded/bare ratios (wall clock: noisy on a shared
machine) and the callback's own work, timed inside the guarded runs (keeping each micro-batch's inputs, the
pre-clip norm, and judging the step; the router hooks run inside the forward and show only in the wall-clock
comparison), as a fraction of a bare step; the target is <= 1 % outside spike steps.

Usage: .venv/bin/python benchmarks/bench_trl_callback.py [--rounds N] [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "capture"))

from trl_run import RunSpec, trainer

from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.trl_callback import attach_spike_guard


def _timed(owner: Any, name: str, spent: list[float]) -> None:
    method = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    setattr(owner, name, wrapped)


def one_run(steps: int, guarded: bool) -> tuple[float, float]:
    """(wall seconds per step, callback seconds per step) of one fresh run."""
    spent: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        run = trainer(Path(tmp), RunSpec(steps=steps, burst_at=None))
        if guarded:
            callback = attach_spike_guard(
                run, Path(tmp) / "spikes", detector=MedianRatioDetector(window=20, threshold=5.0, warmup=10)
            )
            for name in ("_keep", "_keep_norm", "_judge"):
                _timed(callback, name, spent)
        start = time.perf_counter()
        run.train()
        wall = time.perf_counter() - start
    return wall / steps, sum(spent) / steps


def main() -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="bare/guarded pairs after the warm-up pair (default: 3)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default: 8)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    one_run(args.steps, guarded=False)  # warm-up pair: imports, allocator, caches; not counted
    one_run(args.steps, guarded=True)
    bare, guarded, own, ratios = [], [], [], []
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        pair: dict[bool, tuple[float, float]] = {g: one_run(args.steps, guarded=g) for g in order}
        bare.append(pair[False][0])
        guarded.append(pair[True][0])
        own.append(pair[True][1])
        ratios.append(pair[True][0] / pair[False][0])
    b, g, c = statistics.median(bare), statistics.median(guarded), statistics.median(own)
    r = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [r, r, r]
    print(f"TRL GRPOTrainer, tiny qwen3_moe, {args.steps} steps/run, {args.rounds} pairs (A/B, B/A, ...), one thread")
    print(f"bare step    {b * 1e3:9.2f} ms (median of runs)")
    print(f"guarded step {g * 1e3:9.2f} ms (median of runs)")
    print(f"wall-clock ratio guarded/bare, median of pairs {r:.4f} (quartiles {q[0]:.4f} .. {q[2]:.4f})")
    print(f"callback's own work {c * 1e6:9.1f} us/step = {c / b:.5%} of a bare step (target <= 1 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
