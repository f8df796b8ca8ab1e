#!/usr/bin/env python3
"""The guard armed from step 1 against the blind warm-up: its false trips on healthy runs' first steps, side by side
with the spikes it catches in the warm-up of runs with an early burst.

Trains the reference trainer in this process (`trainer_step.RankTrainer`, world size 1, one thread): 20 healthy runs
(preset `none`: the tiny model on 10 seeds, the tiny qwen3_moe and mixtral transformers policies on 5 each) and runs
whose fault bursts inside the warm-up, each beside its healthy twin (the same preset and seed, no burst). Each run's
pre-clip grad-norm series is then judged by the reference trainer's detector (median ratio, window 10, threshold 5,
warm-up 8) with the warm-up blind and armed at several ratios, as a guard with action `log` would judge it (the
decisions do not change the training). A burst step is a true spike when its norm is at least the threshold (5x) its
twin's at that step; a trip on a healthy run's warm-up is a false one, and one on a burst run's other steps is counted
apart (after a burst the policy has moved: its next steps can be genuinely far from the twin's).

Usage: .venv/bin/python benchmarks/bench_guard_warmup.py [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field

import torch

from axrl_spike_replay.capture.detectors import DEFAULT_WARMUP_RATIO, MedianRatioDetector
from axrl_spike_replay.capture.reference.run_config import DetectorSettings, build_run_config, parse_run_config
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer

HEALTHY = {"tiny_moe": range(10), "qwen3_moe": range(5), "mixtral": range(5)}  # 20 runs: model -> seeds
# (model, preset, seed, burst steps): faults that burst inside the warm-up (steps 1-8)
BURSTS = (
    ("tiny_moe", "ratio_outliers", 0, (3,)),
    ("tiny_moe", "stale_old_logprobs", 1, (5,)),
    ("tiny_moe", "reward_scale_bug", 2, (2,)),
    ("tiny_moe", "misaligned_loss_mask", 3, (6, 7)),
    ("qwen3_moe", "reward_scale_bug", 0, (3,)),
    ("qwen3_moe", "engine_logprob_offset", 1, (5,)),
    ("mixtral", "stale_old_logprobs", 0, (4,)),
    ("mixtral", "misaligned_loss_mask", 1, (2,)),
)
RATIOS = (None, 5.0, DEFAULT_WARMUP_RATIO, 20.0)  # None: the blind warm-up the guard had before


def grad_norms(model: str, preset: str, seed: int, burst: tuple[int, ...], steps: int) -> list[float]:
    """The pre-clip global grad norm of each step of one reference-trainer run (every update taken)."""
    overrides = {"train": {"burst": list(burst)}}
    spec = parse_run_config(build_run_config(preset=preset, steps=steps, seed=seed, model=model, overrides=overrides))
    trainer = RankTrainer(spec, rank=0, world_size=1)
    out = []
    for iteration in range(1, steps + 1):
        step = trainer.rollout(iteration)
        grads = trainer.gradients(step)
        out.append(grads.grad_norm)
        trainer.update(grads, step)
    return out


def trips(norms: list[float], ratio: float | None) -> list[int]:
    """The steps (1-based) the reference trainer's detector trips on, with the warm-up armed at `ratio`."""
    det = DetectorSettings()
    detector = MedianRatioDetector(det.window, det.threshold, det.warmup, warmup_ratio=ratio)
    return [step for step, norm in enumerate(norms, start=1) if detector.observe(norm).tripped]


def ratio_before(norms: list[float], step: int) -> float:
    """Step `step`'s norm / the median of the norms before it (what the armed warm-up compares)."""
    before = sorted(norms[: step - 1])
    if not before:
        return math.nan
    mid = len(before) // 2
    median = before[mid] if len(before) % 2 else (before[mid - 1] + before[mid]) / 2
    return norms[step - 1] / median if median > 0 else math.inf


def first_steps_ratio(norms: list[float], warmup: int) -> float:
    """The largest norm / median of the norms before it over the warm-up: how close a healthy run came to a bar."""
    return max(ratio_before(norms, step) for step in range(2, min(warmup, len(norms)) + 1))


@dataclass
class Tally:
    false_trips: int = 0
    runs_with_false_trips: int = 0
    caught: int = 0
    burst_false_trips: int = 0  # trips in a burst run's warm-up on a step that is no true spike (after the burst)
    where: list[str] = field(default_factory=list)


def main() -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per run (default 10: the warm-up of 8, and 2)")
    parser.add_argument("--quick", action="store_true", help="the tiny model only (seconds)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warmup = DetectorSettings().warmup
    threshold = DetectorSettings().threshold
    started = time.perf_counter()
    healthy_models = {m: s for m, s in HEALTHY.items() if not args.quick or m == "tiny_moe"}
    healthy = {(m, s): grad_norms(m, "none", s, (), args.steps) for m, seeds in healthy_models.items() for s in seeds}
    bursts = []
    for model, preset, seed, burst in BURSTS:
        if args.quick and model != "tiny_moe":
            continue
        faulty = grad_norms(model, preset, seed, burst, args.steps)
        twin = grad_norms(model, preset, seed, (), args.steps)
        spikes = [s for s in burst if faulty[s - 1] >= threshold * twin[s - 1]]
        bursts.append((model, preset, seed, burst, faulty, spikes))
    seconds = time.perf_counter() - started
    true_spikes = sum(len(b[5]) for b in bursts)
    print(
        f"{len(healthy)} healthy runs ({', '.join(f'{m} {len(s)}' for m, s in healthy_models.items())}), "
        f"{args.steps} steps each, warm-up {warmup}; {len(bursts)} runs with a burst in the warm-up, "
        f"{true_spikes} true spikes (a burst step >= {threshold:g}x its healthy twin's norm); "
        f"trained in {seconds:.0f} s"
    )
    closest = sorted(((first_steps_ratio(norms, warmup), key) for key, norms in healthy.items()), reverse=True)
    print(
        "largest norm / median of the steps before it in a healthy warm-up: "
        + ", ".join(f"{r:.2f}x ({m} seed {s})" for r, (m, s) in closest[:3])
    )
    print()
    header = (
        f"{'warm-up ratio':<16} {'false trips':>12} {'healthy runs hit':>17} {'caught in warm-up':>18} "
        f"{'after a burst':>14}"
    )
    print(header)
    print("-" * len(header))
    for ratio in RATIOS:
        tally = Tally()
        for key, norms in healthy.items():
            early = [s for s in trips(norms, ratio) if s <= warmup]
            tally.false_trips += len(early)
            tally.runs_with_false_trips += bool(early)
            tally.where += [f"{key[0]} seed {key[1]} step {s}" for s in early]
        for _, _, _, _, faulty, spikes in bursts:
            got = trips(faulty, ratio)
            tally.caught += len([s for s in spikes if s in got])
            tally.burst_false_trips += len([s for s in got if s not in spikes and s <= warmup])
        label = "off (blind)" if ratio is None else f"{ratio:g}"
        label += " (default)" if ratio == DEFAULT_WARMUP_RATIO else ""
        print(
            f"{label:<16} {tally.false_trips:>12} {tally.runs_with_false_trips:>11}/{len(healthy):<5} "
            f"{tally.caught:>12}/{true_spikes:<5} {tally.burst_false_trips:>14}"
        )
        if tally.where:
            print(f"{'':<16} false trips at: {'; '.join(tally.where[:6])}{' ...' if len(tally.where) > 6 else ''}")
    print()
    print("per burst run (steps tripped by the default guard / the blind one):")
    for model, preset, seed, burst, faulty, spikes in bursts:
        ratios = ", ".join(
            f"step {s}: norm {faulty[s - 1]:.3g}, {ratio_before(faulty, s):.3g}x the median before" for s in burst
        )
        print(
            f"  {model} {preset} seed {seed}, burst {list(burst)} ({ratios}; true spikes {spikes}): "
            f"{trips(faulty, DEFAULT_WARMUP_RATIO)} / {trips(faulty, None)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
