"""Where a replay process's gradients live, and how they are reduced and measured: whole or sharded.

`Whole` (each process holds the whole model): a config's local gradient is `torch.autograd.grad` of its loss,
summed over the process's saved ranks, then all-reduced, divided by the saved DP world size and measured as
`training.rank_step` does. This is the trainer's own step, bit for bit.

`Sharded` (FSDP2, `replay.compute.model_build`): a backward reduce-scatters each unit's gradient as it finishes, so
after one pass a process holds its rows of the sum over every process of that pass's gradient. Every process
therefore makes the same number of passes (FSDP's all-gathers and reduce-scatters are collectives): a process
with fewer saved ranks than another makes `None` passes, a forward and a backward of a zero gradient, which
add nothing to the sum but keep the collectives in step; its shard still receives the other processes' part of
that pass. Summed over passes, each process holds its rows of the sum over all saved ranks, which it divides by
the saved world size: what `reduce_grads` gives whole, divided the same way. The global norm and the norm of
each parameter come from the shards' float64 sums of squares, one number per parameter all-reduced; the
tensors never travel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from axrl_spike_replay.replay.compute.outcome_figures import cosine
from axrl_spike_replay.training.rank_step import grad_norm_of, param_norms_of, reduce_grads, sharded_grad_norms

if TYPE_CHECKING:
    from torch import nn

Grads = list[torch.Tensor | None]
T = TypeVar("T")


class GradientSpace(Protocol):
    """How one replay process takes, reduces and measures gradients (`Whole` or `Sharded`)."""

    sharded: bool

    def passes(self, ranks: Sequence[int]) -> list[int | None]:
        """The forward passes this process makes, in order: its saved ranks, then `None` passes (sharded only)."""
        ...

    def backward(
        self, loss: torch.Tensor, logprobs: torch.Tensor | None, retain: bool
    ) -> tuple[Grads, torch.Tensor | None]:
        """(this pass's gradient of `loss` as this process keeps it, dLoss/dlogprobs when `logprobs` is given)."""
        ...

    def zero_backward(self, loss: torch.Tensor, retain: bool) -> Grads:
        """A pass that adds nothing but takes part in the collectives (sharded); what this process received."""
        ...

    def reduce(self, grads: Grads, world_size: int) -> list[torch.Tensor]:
        """The reduced gradient: summed over saved ranks, divided by the saved DP world size."""
        ...

    def norms(self, reduced: list[torch.Tensor]) -> tuple[float, dict[str, float]]:
        """(global L2 norm, {parameter: L2 norm}) of a reduced gradient."""
        ...

    def cosine(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float | None:
        """Cosine of two reduced gradients over every parameter (float64)."""
        ...


def padded_passes(space: GradientSpace, items: Sequence[T]) -> list[T | None]:
    """The passes this process makes over `items` (its ranks' micro-batches): themselves when whole; sharded, then
    `None` passes up to the most any process makes (agreed by an all-reduce: every process calls it together)."""
    if not space.sharded:
        return list(items)
    import torch.distributed as dist

    params = getattr(space, "params", [])
    device = params[0].device if params else torch.device("cpu")
    count = torch.tensor([len(items)], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return [*items, *([None] * (int(count.item()) - len(items)))]


def accumulate(into: Grads, grads: Sequence[torch.Tensor | None]) -> None:
    """`into[i] += grads[i]` (a missing buffer takes the gradient as it is)."""
    for i, g in enumerate(grads):
        if g is None:
            continue
        current = into[i]
        if current is None:
            into[i] = g
        else:
            current.add_(g)


class Whole:
    """The whole model in this process: the trainer's DDP step (`training.rank_step`)."""

    sharded = False

    def __init__(self, model: nn.Module, reduce_dtype: torch.dtype | None = None) -> None:
        self.names = [name for name, _ in model.named_parameters()]
        self.params = list(model.parameters())
        self.reduce_dtype = reduce_dtype  # a recorded precision policy's: each pass's gradient is cast to it

    def passes(self, ranks: Sequence[int]) -> list[int | None]:
        return list(ranks)

    def backward(
        self, loss: torch.Tensor, logprobs: torch.Tensor | None, retain: bool
    ) -> tuple[Grads, torch.Tensor | None]:
        wrt = [*self.params, logprobs] if logprobs is not None else self.params
        got: Grads = list(torch.autograd.grad(loss, wrt, retain_graph=retain, allow_unused=True))
        extra = got.pop() if logprobs is not None else None
        if self.reduce_dtype is not None:
            got = [g.to(self.reduce_dtype) if g is not None else None for g in got]
        return got, extra

    def zero_backward(self, loss: torch.Tensor, retain: bool) -> Grads:
        raise AssertionError("a whole model makes no padding passes")

    def reduce(self, grads: Grads, world_size: int) -> list[torch.Tensor]:
        return reduce_grads(self.params, grads, world_size, self.reduce_dtype)

    def norms(self, reduced: list[torch.Tensor]) -> tuple[float, dict[str, float]]:
        return grad_norm_of(list(reduced)), param_norms_of(self.names, list(reduced))

    def cosine(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float | None:
        return cosine(a, b)


class Sharded:
    """FSDP2 shards in this process: gradients reduce-scattered pass by pass (see the module docstring)."""

    sharded = True

    def __init__(self, model: nn.Module, passes: int) -> None:
        self.names = [name for name, _ in model.named_parameters()]
        self.params = list(model.parameters())
        self.count = passes  # the most saved ranks any process of the group replays

    def passes(self, ranks: Sequence[int]) -> list[int | None]:
        return [*ranks, *([None] * (self.count - len(ranks)))]

    def _take(self) -> Grads:
        """This process's rows of the pass's reduced-scattered sum, taken out of `.grad` (so the next pass starts
        from none, instead of FSDP accumulating into it)."""
        got: Grads = []
        for p in self.params:
            grad = p.grad
            got.append(_local(grad) if grad is not None else None)
            p.grad = None
        return got

    def backward(
        self, loss: torch.Tensor, logprobs: torch.Tensor | None, retain: bool
    ) -> tuple[Grads, torch.Tensor | None]:
        if logprobs is not None:
            logprobs.retain_grad()
        loss.backward(retain_graph=retain)
        extra = None
        if logprobs is not None:
            extra = logprobs.grad if logprobs.grad is not None else torch.zeros_like(logprobs)
            logprobs.grad = None
        return self._take(), extra

    def zero_backward(self, loss: torch.Tensor, retain: bool) -> Grads:
        loss.backward(torch.zeros_like(loss), retain_graph=retain)
        return self._take()

    def outputs_backward(
        self, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor], retain: bool
    ) -> Grads:
        """A backward from `outputs` with `grad_outputs` (zeros on a process that adds nothing to the pass); this
        process's rows of the pass's sum over every process (attribution's one sample at a time)."""
        torch.autograd.backward(list(outputs), list(grad_outputs), retain_graph=retain)
        return self._take()

    def reduce(self, grads: Grads, world_size: int) -> list[torch.Tensor]:
        out = []
        for p, g in zip(self.params, grads, strict=True):
            out.append((torch.zeros_like(_local(p)) if g is None else g).div_(world_size))
        return out

    def norms(self, reduced: list[torch.Tensor]) -> tuple[float, dict[str, float]]:
        return sharded_grad_norms(self.names, list(reduced))

    def cosine(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float | None:
        import torch.distributed as dist

        sums = torch.zeros(3, dtype=torch.float64, device=a[0].device if a else "cpu")
        for x, y in zip(a, b, strict=True):
            x64, y64 = x.double(), y.double()
            sums += torch.stack([(x64 * y64).sum(), (x64 * x64).sum(), (y64 * y64).sum()])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dot, na, nb = sums.tolist()
        if not (na > 0 and nb > 0) or not all(math.isfinite(v) for v in (dot, na, nb)):
            return None
        return max(-1.0, min(1.0, dot / math.sqrt(na * nb)))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
