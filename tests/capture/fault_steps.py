"""A reference trainer's rank and one of its burst steps, as a planted fault at a given stage sees it: what the
held-out fault tests change and compare."""

from __future__ import annotations

import torch

from axrl_spike_replay.capture.fault_injection.faults import StepParts
from axrl_spike_replay.capture.reference.run_config import build_run_config, parse_run_config
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer


def trainer(rank: int = 1, preset: str = "peaked") -> RankTrainer:
    """Rank `rank` of a world-size-2 tiny_moe reference run of `preset`."""
    spec = parse_run_config(build_run_config(preset=preset, steps=4, world_size=2, model="tiny_moe"))
    return RankTrainer(spec, rank=rank, world_size=2)


def step_parts(t: RankTrainer, stage: str, iteration: int = 20) -> tuple[StepParts, dict[str, torch.Tensor]]:
    """A burst step's batch of `t` (its real rollout, no fault) as a fault at `stage` would see it."""
    step = t.rollout(iteration)
    batch = {k: v.clone() for k, v in step.batch.items()}
    parts = StepParts(
        stage, iteration, t.rank, 2, True, t.train.prompt_len, batch, step.routed_experts.clone(), trainer=t
    )
    return parts, step.batch
