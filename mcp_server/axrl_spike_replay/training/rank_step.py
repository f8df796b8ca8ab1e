"""One rank's share of a training step: forward, policy loss, backward, and the DP gradient reduction.

The reference trainer and the replay engine both call these, so a replay recomputes exactly what
training computed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from axrl_spike_replay.models.policy import policy_forward
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.policy_loss import LossConfig, LossOutput, policy_loss


def rank_forward_backward(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    loss_cfg: LossConfig,
    routing: RoutingControl,
    *,
    backward: bool = True,
    counts: GlobalCounts | None = None,
) -> LossOutput:
    """Forward the rank's batch, compute its loss, and (by default) accumulate its gradients.

    Any policy kind (`models.policy`): the log-probs are taken by `policy_forward`, as replay takes them.
    `counts`: the step's global counts, for `normalization: global`."""
    out = policy_forward(model, batch, routing, need_entropy=bool(loss_cfg.entropy_coef))
    result = policy_loss(
        out.logprobs, batch, loss_cfg, entropy=out.entropy, aux_loss=out.aux_loss, z_loss=out.z_loss, counts=counts
    )
    if backward:
        result.loss.backward()
    return result


def param_grad_norms(model: nn.Module) -> dict[str, float]:
    """L2 norm of each parameter's current gradient (0 where it has none)."""
    return gradient_norms((name, p.grad) for name, p in model.named_parameters())


def gradient_norms(named: Iterable[tuple[str, torch.Tensor | None]]) -> dict[str, float]:
    """{name: L2 norm} of named gradients (0 for None), computed as the trainer records its per-parameter norms."""
    return {name: (float(g.detach().float().norm()) if g is not None else 0.0) for name, g in named}


def reduce_gradients(model: nn.Module, world_size: int) -> None:
    """Sum gradients over the process group and divide by the data-parallel world size (DDP's mean).

    With one process standing in for several saved ranks, its gradients already hold their sum;
    `world_size` is always the saved DP size so each rank keeps its own normalisation.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if distributed:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad.div_(world_size)


def global_grad_norm(model: nn.Module) -> float:
    """Global pre-clip L2 norm over all parameter gradients (fp64 accumulation)."""
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return math.sqrt(total)
