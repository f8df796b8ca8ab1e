"""One piece of the model's gradient (a decoder layer, the head, the embedding), summed over every saved rank's
micro-batches and measured as the whole replay measures it, then freed.

The whole replay (`replay.compute.worker`, `Whole`) sums each pass's gradient into the step's, in the order of the saved
ranks and their micro-batches, keeps each rank's own (the sum of its micro-batches) long enough to take its
per-parameter norms, then divides the sum by the saved world size and takes every parameter's norm and its float64
sum of squares (`training.rank_step`). A piece does the same for its own parameters, passes in the same order, so a
streamed step's figures are the whole step's, put together piece by piece (`StepFigures`). Split over processes,
a `RankChain` keeps that order across them.

A weight two pieces share (tied input and output embeddings) is summed in the first (the head) and not measured
there (`hand_on`): the second (the embedding) starts from that sum (`seed`) and each saved rank's own from that
rank's head half (`defer`, then `resume`: kept in between where the caller keeps it, the layer boundaries' store),
so its norms are taken once, of the whole gradient. Every pass's head half is added
before any pass's embedding half: the whole replay adds each pass's two halves first, a rounding apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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
        self.defer: Callable[[int, list[torch.Tensor | None]], None] | None = None  # each rank's own, handed on
        self.resume: Callable[[int], list[torch.Tensor | None]] | None = None  # each rank's own, begun before
        # a part of a parameter split over processes (`expert_share`): its norms from float64 sums of squares, so
        # those of its parts put together are its own to float64 rounding, not a float32 norm's
        self.precise: frozenset[str] = frozenset()

    def seed(self, names: Sequence[str], values: Sequence[torch.Tensor | None]) -> None:
        """Start the sum of `names` from `values` (a shared weight's sum over the piece before; alone, or on the
        first process of a chain: the others receive it with the running sum)."""
        if self.chain is not None and not self.chain.first:
            return
        self._start()
        at = {name: i for i, name in enumerate(self.names)}
        for name, value in zip(names, values, strict=True):
            if value is not None:
                self.total[at[name]] = value

    def _own_begun(self, rank: int) -> list[torch.Tensor | None]:
        """Rank `rank`'s own gradient as a piece before left it (`resume`; empty when none did)."""
        return self.resume(rank) if self.resume is not None else []

    def _own_done(self, rank: int) -> None:
        if self.defer is not None:  # a copy: a one-pass rank's own is the sum's own tensor until the next rank adds
            self.defer(rank, [g.clone() if g is not None else None for g in self.own])
        else:
            self.rank_norms[rank] = gradient_norms(zip(self.names, self.own, strict=False))
            for name, g in zip(self.names, self.own, strict=False):
                if name in self.precise and g is not None:
                    self.rank_norms[rank][name] = math.sqrt(squares64(g))
        self.own = []

    def add(self, rank: int, grads: Sequence[torch.Tensor | None], passes_of_rank: int) -> None:
        """One pass of saved rank `rank` (which makes `passes_of_rank` passes in all, consecutively)."""
        self._start()
        local = list(grads)
        if self.reduce_dtype is not None:
            local = [g.to(self.reduce_dtype) if g is not None else None for g in local]
        if self.keep_own:
            if self.own_rank != rank:
                self.own_rank, self.own, self.own_passes = rank, self._own_begun(rank), 0
            if passes_of_rank == 1 and not self.own:
                self.own = local
            else:
                if not self.own:
                    self.own = [None] * len(self.names)
                accumulate(self.own, [g.clone() if g is not None else None for g in local])
            self.own_passes += 1
            if self.own_passes == passes_of_rank:
                self._own_done(rank)
        accumulate(self.total, local)

    def skip(self, rank: int, passes_of_rank: int) -> None:
        """A pass of a rank left out of the step: nothing of it reaches the sum (its own gradient stays empty)."""
        if not self.keep_own:
            return
        if self.own_rank != rank:
            self.own_rank, self.own, self.own_passes = rank, self._own_begun(rank), 0
        if passes_of_rank > 1 and not self.own:
            self.own = [None] * len(self.names)
        self.own_passes += 1
        if self.own_passes == passes_of_rank and self.own:
            self._own_done(rank)

    def _start(self) -> None:
        """Take the previous processes' running sum before this process's first pass (once per piece)."""
        if not self.started and self.chain is not None:
            self.total = self.chain.receive(len(self.names))
        self.started = True

    def reduced(self) -> list[torch.Tensor | None]:
        """The sum divided by the saved world size (`reduce_grads`' mean); None where no pass had a gradient."""
        return [g.div_(self.world_size) if g is not None else None for g in self.total]

    def hand_on(self) -> list[torch.Tensor | None]:
        """The sum, not reduced nor measured, for the piece that goes on with these weights (`seed`): alone or on
        the last process of a chain; Nones on the others, which hand theirs on down the chain."""
        self._start()
        total = self.total
        self.total = [None] * len(self.names)
        self.started = self.chain is None
        if self.chain is not None and not self.chain.last:
            self.chain.send(total)
            return [None] * len(self.names)
        return total

    def measure(self, into: StepFigures) -> list[torch.Tensor | None]:
        """Reduce, and put the piece's sums of squares and norms into `into`; the reduced gradient. In a chain
        only the last process measures the sum (the others hand theirs on and give Nones, or the last's reduced
        sum where the chain spreads it: `RankChain.everywhere`); every process puts in its own saved ranks' norms."""
        self._start()
        for rank, norms in self.rank_norms.items():
            into.rank_norms.setdefault(rank, {}).update(norms)
        if self.chain is not None and not self.chain.last:
            self.chain.send(self.total)
            self.total = [None] * len(self.names)
            self.started = False
            empty: list[torch.Tensor | None] = [None] * len(self.names)
            return self.chain.spread(empty) if self.chain.everywhere else empty
        reduced = self.reduced()
        for name, g in zip(self.names, reduced, strict=True):
            into.squares[name] = squares64(g) if g is not None else 0.0
        into.norms.update(gradient_norms(zip(self.names, reduced, strict=True)))
        for name in self.precise & set(self.names):
            into.norms[name] = math.sqrt(into.squares[name])
        self.total = [None] * len(self.names)
        self.started = self.chain is None
        if self.chain is not None and self.chain.everywhere:
            self.chain.spread(reduced)
        return reduced
