"""A reference trainer's rank and one of its burst steps, as a planted fault at a given stage sees it: what the
held-out fault tests change and compare."""

from __future__ import annotations

import torch

from axrl_spike_replay.capture.fault_injection.faults import StepParts
from axrl_spike_replay.capture.reference.run_config import build_run_config, parse_run_config
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.rank_step import rank_forward_backward
from axrl_spike_replay.training.routing_replay import routing_control


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


def gradients(t: RankTrainer) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of `t`'s model as it stands (zeros where none)."""
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in t.model.named_parameters()}


def backward_gradients(
    t: RankTrainer, batch: dict[str, torch.Tensor], routes: torch.Tensor | None, loss: LossConfig | None = None
) -> dict[str, torch.Tensor]:
    """The rank's gradients of its loss on `batch` under `routes` (and `loss`, the run's by default), from zero."""
    t.model.zero_grad(set_to_none=True)
    rank_forward_backward(t.model, batch, loss or t.spec.loss, routing_control(t.spec.routing, batch, routes))
    return gradients(t)
