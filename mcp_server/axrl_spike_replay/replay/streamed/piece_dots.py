"""Dot products of several configs' streamed gradients, piece by piece, never more than one piece of each at once.

A streamed backward holds one piece of the model's gradient at a time (a decoder layer, the head, the embedding),
reduced and measured, then freed (`layer_passes.backward_steps`). The dot product of two configs' gradients is the
sum over pieces of their pieces' dot products, so their backwards are taken in turn a piece at a time (`together`):
the reference's piece first, kept, then each other config's same piece, dotted with it (float64) and dropped. The
float64 sums of squares come from each config's own figures (`StepFigures.squares`), so a cosine is the whole
replay's (`outcome_figures.cosine`) put together piece by piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence

import torch

from axrl_spike_replay.replay.streamed.layer_gradients import StepFigures
from axrl_spike_replay.replay.streamed.layer_passes import ConfigPass, PieceHook

Steps = Generator[str, None, ConfigPass]


def dot64(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 20) -> float:
    """The float64 dot product of two tensors, a chunk of elements at a time (no float64 copy of either whole)."""
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    total = 0.0
    for start in range(0, x.numel(), chunk):
        total += float((x[start : start + chunk].double() * y[start : start + chunk].double()).sum())
    return total


class PieceDots:
    """Each other config's dot product with the reference's gradient, summed piece by piece (see the module
    docstring): `reference` is the reference's piece hook, `other(i)` the i-th other config's."""

    def __init__(self, others: int, counted: Callable[[str], bool] | None = None) -> None:
        self.held: dict[str, torch.Tensor] = {}  # the reference's current piece, by parameter
        self.label = ""
        self.dots = [0.0] * others
        self.counted = counted  # experts split over processes: the parameters this process's dots count

    def reference(self, label: str, names: Sequence[str], reduced: Sequence[torch.Tensor | None]) -> None:
        """Keep the reference's piece (the previous one is dropped)."""
        self.label = label
        self.held = {name: g for name, g in zip(names, reduced, strict=True) if g is not None}

    def other(self, index: int) -> PieceHook:
        """The hook of the `index`-th other config: its piece dotted with the reference's same piece."""

        def hook(label: str, names: Sequence[str], reduced: Sequence[torch.Tensor | None]) -> None:
            if label != self.label:
                raise AssertionError(f"pieces out of step: {label} against the reference's {self.label}")
            for name, g in zip(names, reduced, strict=True):
                kept = self.held.get(name)
                if g is not None and kept is not None and (self.counted is None or self.counted(name)):
                    self.dots[index] += dot64(g, kept)

        return hook


def together(steps: Sequence[Steps]) -> list[ConfigPass]:
    """Several configs' backwards taken a piece at a time in turn, the first's piece first; their passes."""
    done: list[ConfigPass | None] = [None] * len(steps)
    while any(d is None for d in done):
        labels = set()
        for i, step in enumerate(steps):
            if done[i] is not None:
                continue
            try:
                labels.add(next(step))
            except StopIteration as finished:
                done[i] = finished.value
        if len(labels) > 1:
            raise AssertionError(f"the configs' backwards are out of step: {sorted(labels)}")
    return [d for d in done if d is not None]


def cosine_of(dot: float, a: StepFigures, b: StepFigures) -> float | None:
    """The cosine of two gradients from their dot product and their per-parameter float64 sums of squares (None
    when either is 0 or a figure is not finite, as `outcome_figures.cosine`)."""
    na, nb = math.fsum(a.squares.values()), math.fsum(b.squares.values())
    if not (na > 0 and nb > 0) or not all(math.isfinite(v) for v in (dot, na, nb)):
        return None
    return max(-1.0, min(1.0, dot / math.sqrt(na * nb)))
