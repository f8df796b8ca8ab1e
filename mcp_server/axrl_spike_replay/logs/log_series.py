"""A training log's grad-norm / loss series, held compactly: three numbers and a flag byte per logged point.

A dict per point costs ~300 bytes; a 1 M-iteration log held that way took more memory than the scan itself.
Here points are appended in log order to typed arrays (26 bytes each) and settled once at the end: sorted
by iteration, the last logged value of an iteration winning, as a dict updated line by line would give.
`SeriesPoints` reads the settled arrays as a sequence of `{"iteration", "grad_norm", "loss"}` dicts, made
only when asked for.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

_INT64 = range(-(2**63), 2**63)
_HAS_GRAD, _HAS_LOSS = 1, 2
_CHUNK = 4096  # points turned into dicts at a time while iterating


class SeriesBuilder:
    """Points in log order: `append` one, `extend_read` many read with every value present."""

    def __init__(self) -> None:
        self.iterations = array("q")
        self.grads = array("d")
        self.losses = array("d")
        self.flags = bytearray()
        # iterations outside int64 (a key=value step of 1e30 is still a step): few, kept as Python objects
        self.huge: list[tuple[int, float | None, float | None]] = []

    def __len__(self) -> int:
        return len(self.iterations) + len(self.huge)

    def append(self, iteration: int, grad: float | None, loss: float | None) -> None:
        """One point, logged after those appended before."""
        if iteration not in _INT64:
            self.huge.append((iteration, grad, loss))
            return
        self.iterations.append(iteration)
        self.grads.append(math.nan if grad is None else grad)
        self.losses.append(math.nan if loss is None else loss)
        self.flags.append((grad is not None) * _HAS_GRAD | (loss is not None) * _HAS_LOSS)

    def extend_read(self, iterations: Sequence[int], grads: Sequence[float], losses: Sequence[float]) -> None:
        """Points with a grad norm and a loss each, in log order (the three of equal length)."""
        try:
            its = array("q", iterations)  # whole, or nothing when one does not fit
        except OverflowError:
            for it, grad, loss in zip(iterations, grads, losses, strict=True):
                self.append(it, grad, loss)
            return
        self.iterations += its
        self.grads += array("d", grads)
        self.losses += array("d", losses)
        self.flags += bytes([_HAS_GRAD | _HAS_LOSS]) * len(its)

    def extend_arrays(self, iterations: np.ndarray, grads: np.ndarray, losses: np.ndarray) -> None:
        """`extend_read` of int64 / float64 arrays of equal length."""
        self.iterations.frombytes(np.ascontiguousarray(iterations, dtype=np.int64).tobytes())
        self.grads.frombytes(np.ascontiguousarray(grads, dtype=np.float64).tobytes())
        self.losses.frombytes(np.ascontiguousarray(losses, dtype=np.float64).tobytes())
        self.flags += bytes([_HAS_GRAD | _HAS_LOSS]) * len(iterations)

    def extend_builder(self, later: SeriesBuilder) -> None:
        """The points of `later`, logged after those here."""
        self.iterations += later.iterations
        self.grads += later.grads
        self.losses += later.losses
        self.flags += later.flags
        self.huge += later.huge

    def settled(self) -> tuple[SeriesPoints, int]:
        """(the series in iteration order, the last logged value of each iteration; how many points were
        logged for an iteration logged before). The builder takes no more points after this."""
        its = np.frombuffer(self.iterations, dtype=np.int64) if self.iterations else np.zeros(0, np.int64)
        grads = np.frombuffer(self.grads, dtype=np.float64) if self.grads else np.zeros(0)
        losses = np.frombuffer(self.losses, dtype=np.float64) if self.losses else np.zeros(0)
        flags = np.frombuffer(self.flags, dtype=np.uint8) if self.flags else np.zeros(0, np.uint8)
        iterations: np.ndarray = its
        repeated = 0
        if not bool(np.all(its[1:] > its[:-1])):  # logged out of order or again: the last of each, sorted
            order = np.argsort(its, kind="stable")
            last = np.ones(len(order), dtype=bool)
            last[:-1] = its[order[:-1]] != its[order[1:]]
            keep = order[last]
            del order, last
            iterations, grads, losses, flags = its[keep], grads[keep], losses[keep], flags[keep]
            repeated = len(its) - keep.size
        # in order (the usual case): the arrays are read where they are, the builder takes no more points
        if self.huge:
            latest: dict[int, tuple[float | None, float | None]] = {}
            for it, grad, loss in self.huge:
                repeated += it in latest
                latest[it] = (grad, loss)
            below = sorted(k for k in latest if k < 0)
            above = sorted(k for k in latest if k > 0)

            def values(keys: list[int], at: int) -> list[float]:
                return [math.nan if (v := latest[k][at]) is None else v for k in keys]

            def present(keys: list[int]) -> list[int]:
                return [(latest[k][0] is not None) * _HAS_GRAD | (latest[k][1] is not None) * _HAS_LOSS for k in keys]

            iterations = np.array([*below, *iterations.tolist(), *above], dtype=object)
            grads = np.concatenate([values(below, 0), grads, values(above, 0)])
            losses = np.concatenate([values(below, 1), losses, values(above, 1)])
            flags = np.concatenate([present(below), flags, present(above)]).astype(np.uint8)
        return SeriesPoints(iterations, grads, losses, flags), repeated


@dataclass(frozen=True, eq=False)
class SeriesPoints(Sequence[dict[str, Any]]):
    """The series in iteration order, read as `{"iteration", "grad_norm", "loss"}` dicts (None: not logged)."""

    iterations: np.ndarray  # int64 (object when an iteration does not fit)
    grads: np.ndarray  # float64; NaN where not logged (see `flags`)
    losses: np.ndarray
    flags: np.ndarray  # uint8: 1 grad norm logged, 2 loss logged

    def __len__(self) -> int:
        return len(self.iterations)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return self.points(np.arange(len(self))[index])
        if not -len(self) <= index < len(self):
            raise IndexError("series index out of range")
        return self.points(np.array([index]))[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self), _CHUNK):
            yield from self.points(np.arange(start, min(len(self), start + _CHUNK)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SeriesPoints | list | tuple):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))

    def points(self, at: np.ndarray) -> list[dict[str, Any]]:
        """The points at positions `at`, as dicts."""
        grads = _with_none(self.grads[at], self.flags[at] & _HAS_GRAD)
        losses = _with_none(self.losses[at], self.flags[at] & _HAS_LOSS)
        return [
            {"iteration": it, "grad_norm": grad, "loss": loss}
            for it, grad, loss in zip(self.iterations[at].tolist(), grads, losses, strict=True)
        ]


def _with_none(values: np.ndarray, present: np.ndarray) -> list[float | None]:
    out: list[Any] = values.tolist()
    if not present.all():
        for at in np.flatnonzero(present == 0).tolist():
            out[at] = None
    return out
