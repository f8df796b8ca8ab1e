"""One rank's share of a training step: forward, policy loss, backward, and the DP gradient reduction.

The reference trainer and the replay engine both call these, so a replay recomputes exactly what
training computed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

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


def param_norms_of(names: Sequence[str], grads: Sequence[torch.Tensor | None]) -> dict[str, float]:
    """L2 norm of each named gradient (0 where there is none)."""
    return gradient_norms(zip(names, grads, strict=True))


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def reduce_grads(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    world_size: int,
    reduce_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """The gradients summed over the process group and divided by the data-parallel world size (DDP's mean),
    in `reduce_dtype` (None: each gradient's own dtype; a mixed-precision trainer's reduce dtype otherwise).

    With one process standing in for several saved ranks, its gradients already hold their sum;
    `world_size` is always the saved DP size so each rank keeps its own normalisation.
    """
    import torch.distributed as dist

    distributed = _distributed()
    out = []
    for p, g in zip(params, grads, strict=True):
        if g is None:
            g = torch.zeros_like(p, dtype=reduce_dtype or p.dtype)
        elif reduce_dtype is not None and g.dtype != reduce_dtype:
            g = g.to(reduce_dtype)
        if distributed:
            dist.all_reduce(g, op=dist.ReduceOp.SUM)
        out.append(g.div_(world_size))
    return out


def reduce_gradients(model: nn.Module, world_size: int) -> None:
    """`reduce_grads` on the model's `.grad`s, in place (the reference trainer's DP step)."""
    params = list(model.parameters())
    for p, g in zip(params, reduce_grads(params, [p.grad for p in params], world_size), strict=True):
        p.grad = g


def global_grad_norm(model: nn.Module) -> float:
    """Global pre-clip L2 norm over all parameter gradients (fp64 accumulation)."""
    return grad_norm_of([p.grad for p in model.parameters()])


def grad_norm_of(grads: Sequence[torch.Tensor | None]) -> float:
    """Global L2 norm of whole gradients (fp64 accumulation, in parameter order)."""
    total = 0.0
    for g in grads:
        if g is not None:
            total += float(g.detach().double().pow(2).sum())
    return math.sqrt(total)


def sharded_grad_norms(names: Sequence[str], shards: Sequence[torch.Tensor | None]) -> tuple[float, dict[str, float]]:
    """(global norm, {name: norm}) of gradients each process holds a shard of (FSDP's reduced, sharded gradients):
    every shard's fp64 sum of squares, summed over the process group (one all-reduce of one number per
    parameter: the norms travel, never the tensors)."""
    import torch.distributed as dist

    device = next((s.device for s in shards if s is not None), torch.device("cpu"))  # NCCL reduces on the GPU
    squares = torch.tensor(
        [float(s.detach().double().pow(2).sum()) if s is not None else 0.0 for s in shards],
        dtype=torch.float64,
        device=device,
    )
    if _distributed():
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    total = 0.0
    for value in squares.tolist():
        total += value
    return math.sqrt(total), {name: math.sqrt(v) for name, v in zip(names, squares.tolist(), strict=True)}
