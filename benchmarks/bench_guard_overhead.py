#!/usr/bin/env python3
"""Spike guard per-step overhead vs the bare training step of the reference trainer, side by side in one run.

Alternates bare steps (rollout, gradients, clipped Adam update) and guarded steps (the same plus
`guard.observe` and `guard.apply`) on one reference trainer (world size 1, one thread, preset
`none`, so nothing trips), and also times the guard calls alone inside the guarded steps. Prints
the guard's cost as a fraction of a bare step; the target is <= 2 %.

Usage: .venv/bin/python benchmarks/bench_guard_overhead.py [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.reference.run_config import build_run_config, parse_run_config
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer
from axrl_spike_replay.capture.spike_guard import SpikeGuard


def main() -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of each kind (default: 200)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = parse_run_config(build_run_config(preset="none", steps=2 * args.steps + 20))
    trainer = RankTrainer(spec, rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        guard = SpikeGuard(Path(tmp), action="skip", detector=MedianRatioDetector(window=20, threshold=5.0, warmup=10))
        bare, guarded, guard_only = [], [], []
        iteration = 0
        for i in range(2 * args.steps + 10):
            iteration += 1
            use_guard = i % 2 == 1
            start = time.perf_counter()
            step = trainer.rollout(iteration)
            grads = trainer.gradients(step)
            apply = True
            if use_guard:
                g0 = time.perf_counter()
                decision = guard.observe(iteration, grads.grad_norm)
                apply = guard.apply(decision, trainer.model, trainer.optimizer)
                guard_time = time.perf_counter() - g0
            if apply:
                trainer.update(grads, step)
            elapsed = time.perf_counter() - start
            if i < 10:  # warm-up
                continue
            if use_guard:
                if decision.tripped:
                    continue
                guarded.append(elapsed)
                guard_only.append(guard_time)
            else:
                bare.append(elapsed)
    bare_ms = statistics.median(bare) * 1e3
    guarded_ms = statistics.median(guarded) * 1e3
    guard_us = statistics.median(guard_only) * 1e6
    print(f"bare training step     p50 {bare_ms:8.3f} ms  ({len(bare)} steps)")
    print(f"guarded training step  p50 {guarded_ms:8.3f} ms  ({len(guarded)} steps)")
    print(f"guard calls alone      p50 {guard_us:8.1f} us  (observe + apply, inside the guarded steps)")
    print(f"guard overhead: {guard_us / 1e3 / bare_ms:.3%} of a bare step (target <= 2%)")
    print(f"guarded / bare step time: {guarded_ms / bare_ms:.3f}x (includes run-to-run noise)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
