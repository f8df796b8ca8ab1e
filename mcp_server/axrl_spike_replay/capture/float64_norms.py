"""A module's gradient norms in float64, from the gradients themselves, however FSDP shards them.

A trainer's clip reports the global norm in the gradients' dtype: float32 sums, whose rounding grows with the
number of elements (on the CPU, 0.4% for one 50M-element tensor) and at scale exceeds the 1e-6 a full-fidelity
replay is held to. A snapshot records float64 instead: each gradient's norm accumulated in float64, the global one
combined the way torch's own `get_total_norm` combines a sharded module's (for FSDP2's DTensor gradients, norms of
the local shards reduced over the mesh by DTensor; for FSDP1's flat shards, a sum of squares all-reduced over its
process group). Computing a norm in float64 makes a float64 copy of one local shard at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Float64Norms:
    """`global_norm`: the norm of every gradient of the module, over all ranks; `local`: each parameter's norm of
    this rank's part of its gradient (its shard under FSDP, 0.0 without a gradient)."""

    global_norm: float
    local: dict[str, float]


def _fsdp1_group(module: Any) -> Any:
    """FSDP1's shard process group when `module` is wrapped in FullyShardedDataParallel, else None."""
    from torch.distributed import fsdp

    kind = getattr(fsdp, "FullyShardedDataParallel", None)
    return getattr(module, "process_group", None) if kind is not None and isinstance(module, kind) else None


def float64_grad_norms(module: Any) -> Float64Norms:
    """The module's global and per-parameter gradient norms in float64. Collective when the gradients are
    sharded (every rank of the module's group must call it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local: dict[str, float] = {}
    sharded: list[Any] = []  # float64 norms of DTensor gradients (partial over their mesh)
    plain_sq = 0.0
    for name, param in module.named_parameters():
        grad = param.grad
        if grad is None:
            local[name] = 0.0
            continue
        own = grad.to_local() if isinstance(grad, DTensor) else grad
        local[name] = float(torch.linalg.vector_norm(own.detach(), 2, dtype=torch.float64))
        if isinstance(grad, DTensor):
            sharded.append(torch.linalg.vector_norm(grad.detach(), 2, dtype=torch.float64))
        else:
            plain_sq += local[name] ** 2
    group = _fsdp1_group(module)
    if group is not None and dist.is_initialized():
        total = torch.tensor([plain_sq], dtype=torch.float64, device=_collective_device(group))
        dist.all_reduce(total, group=group)
        plain_sq = float(total[0])
    sharded_sq = 0.0
    if sharded:
        norm = torch.linalg.vector_norm(torch.stack(sharded), 2)
        sharded_sq = float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    return Float64Norms(global_norm=math.sqrt(plain_sq + sharded_sq), local=local)


def _collective_device(group: Any) -> Any:
    """Where a collective's tensor must live for `group`: the current CUDA device under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
