"""One piece of the model's gradient (a decoder layer, the head, the embedding), summed over every saved rank's
micro-batches and measured as the whole replay measures it, then freed.

The whole replay (`replay.compute.worker`, `Whole`) sums each pass's gradient into the step's, in the order of the saved
ranks and their micro-batches, keeps each rank's own (the sum of its micro-batches) long enough to take its
per-parameter norms, then divides the sum by the saved world size and takes every parameter's norm and its float64
sum of squares (`training.rank_step`). A piece does the same for its own parameters, passes in the same order, so a
streamed step's figures are the whole step's, put together piece by piece (`StepFigures`). Split over processes,
a `RankChain` keeps that order across them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from axrl_spike_replay.replay.compute.gradient_space import accumulate
from axrl_spike_replay.replay.streamed.rank_chain import RankChain
from axrl_spike_replay.training.rank_step import gradient_norms


def squares64(tensor: torch.Tensor, chunk: int = 1 << 20) -> float:
    """The float64 sum of squares of `tensor`, a chunk of elements at a time (no float64 copy of the whole)."""
    flat = tensor.detach().reshape(-1)
    total = 0.0
    for start in range(0, flat.numel(), chunk):
        total += float(flat[start : start + chunk].double().pow(2).sum())
    return total


@dataclass
class StepFigures:
    """A config's gradient figures gathered piece by piece: float64 sums of squares and norms per parameter, each
    saved rank's own per-parameter norms, and the per-piece dot products the experiments ask for."""

    squares: dict[str, float] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)
    rank_norms: dict[int, dict[str, float]] = field(default_factory=dict)

    def grad_norm(self, order: Sequence[str]) -> float:
        """The global norm: the sums of squares added in parameter order (`grad_norm_of`'s)."""
        total = 0.0
        for name in order:
            total += self.squares.get(name, 0.0)
        return math.sqrt(total)


class PieceGradient:
    """The step's gradient of the parameters `names`, pass by pass (see the module docstring)."""

    def __init__(
        self,
        names: Sequence[str],
        world_size: int,
        reduce_dtype: torch.dtype | None = None,
        keep_own: bool = False,
        chain: RankChain | None = None,
    ) -> None:
        self.names = list(names)
        self.chain = chain  # several processes: the sum starts from the previous ones' (`rank_chain`)
        self.started = chain is None
        self.world_size = world_size
        self.reduce_dtype = reduce_dtype
        self.keep_own = keep_own
        self.total: list[torch.Tensor | None] = [None] * len(self.names)
        self.own: list[torch.Tensor | None] = []
        self.own_rank: int | None = None
        self.own_passes = 0
        self.rank_norms: dict[int, dict[str, float]] = {}

    def add(self, rank: int, grads: Sequence[torch.Tensor | None], passes_of_rank: int) -> None:
        """One pass of saved rank `rank` (which makes `passes_of_rank` passes in all, consecutively)."""
        self._start()
        local = list(grads)
        if self.reduce_dtype is not None:
            local = [g.to(self.reduce_dtype) if g is not None else None for g in local]
        if self.keep_own:
            if self.own_rank != rank:
                self.own_rank, self.own, self.own_passes = rank, [], 0
            if passes_of_rank == 1:
                self.own = local
            else:
                if not self.own:
                    self.own = [None] * len(self.names)
                accumulate(self.own, [g.clone() if g is not None else None for g in local])
            self.own_passes += 1
            if self.own_passes == passes_of_rank:
                self.rank_norms[rank] = gradient_norms(zip(self.names, self.own, strict=False))
                self.own = []
        accumulate(self.total, local)

    def skip(self, rank: int, passes_of_rank: int) -> None:
        """A pass of a rank left out of the step: nothing of it reaches the sum (its own gradient stays empty)."""
        if not self.keep_own:
            return
        if self.own_rank != rank:
            self.own_rank, self.own, self.own_passes = rank, [], 0
        if passes_of_rank > 1 and not self.own:
            self.own = [None] * len(self.names)
        self.own_passes += 1
        if self.own_passes == passes_of_rank and self.own:
            self.rank_norms[rank] = gradient_norms(zip(self.names, self.own, strict=False))
            self.own = []

    def _start(self) -> None:
        """Take the previous processes' running sum before this process's first pass (once per piece)."""
        if not self.started and self.chain is not None:
            self.total = self.chain.receive(len(self.names))
        self.started = True

    def reduced(self) -> list[torch.Tensor | None]:
        """The sum divided by the saved world size (`reduce_grads`' mean); None where no pass had a gradient."""
        return [g.div_(self.world_size) if g is not None else None for g in self.total]

    def measure(self, into: StepFigures) -> list[torch.Tensor | None]:
        """Reduce, and put the piece's sums of squares and norms into `into`; the reduced gradient. In a chain
        only the last process measures the sum (the others hand theirs on and give Nones); every process puts in
        its own saved ranks' norms."""
        self._start()
        if self.chain is not None and not self.chain.last:
            self.chain.send(self.total)
            for rank, norms in self.rank_norms.items():
                into.rank_norms.setdefault(rank, {}).update(norms)
            self.total = [None] * len(self.names)
            self.started = False
            return [None] * len(self.names)
        reduced = self.reduced()
        for name, g in zip(self.names, reduced, strict=True):
            into.squares[name] = squares64(g) if g is not None else 0.0
        into.norms.update(gradient_norms(zip(self.names, reduced, strict=True)))
        for rank, norms in self.rank_norms.items():
            into.rank_norms.setdefault(rank, {}).update(norms)
        self.total = [None] * len(self.names)
        self.started = self.chain is None
        return reduced
