"""Down-sampling a long grad-norm series for output, keeping its spikes and their neighbourhoods exact.

A 1 M-iteration series is an 86 MB JSON document; people and programs reading `logs` want its shape and its
spikes. The sample keeps only real points (no averages): the first and last, every point within `around`
iterations (by position) of a spike, and the lowest and highest grad norm of each of a fixed number of
equal buckets, so the envelope of the curve (and any bump the detector did not flag) stays visible.
A compact series (`SeriesPoints`) is sampled with array operations, to the same points.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import numpy as np

from axrl_spike_replay.logs.log_series import SeriesPoints

DEFAULT_LIMIT = 2000
DEFAULT_AROUND = 20


def _iteration(point: dict[str, Any]) -> int:
    return point["iteration"]


def sampled_series(
    points: Sequence[dict[str, Any]],
    spike_iterations: Sequence[int],
    *,
    limit: int = DEFAULT_LIMIT,
    around: int = DEFAULT_AROUND,
) -> list[dict[str, Any]]:
    """At most about `limit` points of `points` (in iteration order) plus the spikes' neighbourhoods;
    `points` itself when it is no longer than `limit`."""
    if len(points) <= limit:
        return list(points)
    if isinstance(points, SeriesPoints):
        return points.points(np.array(sorted(_kept(points, spike_iterations, limit, around)), dtype=np.int64))
    keep = _around_spikes(len(points), [_at(points, i) for i in spike_iterations], around)
    for start, size in _buckets(len(points), limit - len(keep)):
        _keep_extremes(points, range(start, min(len(points), start + size)), keep)
    return [points[i] for i in sorted(keep)]


def _at(points: Sequence[dict[str, Any]], iteration: int) -> int | None:
    """The position of `iteration` (points are in iteration order: found by bisection, no index built)."""
    at = bisect_left(points, iteration, key=_iteration)
    return at if at < len(points) and points[at]["iteration"] == iteration else None


def _around_spikes(count: int, spikes: list[int | None], around: int) -> set[int]:
    keep = {0, count - 1}
    for at in spikes:
        if at is not None:
            keep.update(range(max(0, at - around), min(count, at + around + 1)))
    return keep


def _buckets(count: int, room: int) -> list[tuple[int, int]]:
    buckets = max(1, room // 2)
    size = -(-count // buckets)
    return [(start, size) for start in range(0, count, size)]


def _keep_extremes(points: Sequence[dict[str, Any]], bucket: range, keep: set[int]) -> None:
    """The lowest and highest grad norm of the bucket (ties and NaN as `min`/`max` of (norm, position) give)."""
    norms = [(points[i]["grad_norm"], i) for i in bucket if points[i]["grad_norm"] is not None]
    if norms:
        keep.add(min(norms)[1])
        keep.add(max(norms)[1])
    else:
        keep.add(bucket.start)


def _kept(points: SeriesPoints, spike_iterations: Sequence[int], limit: int, around: int) -> set[int]:
    """The positions `sampled_series` keeps, by whole-bucket array operations where a bucket's norms are all
    logged and not NaN (its min is the first lowest, its max the last highest); other buckets point by point."""
    count = len(points)
    iterations = points.iterations
    spikes: list[int | None] = []
    for iteration in spike_iterations:
        at = int(np.searchsorted(iterations, iteration)) if iterations.dtype != object else None
        if at is None:
            at = bisect_left(iterations.tolist(), iteration)
        spikes.append(at if at < count and iterations[at] == iteration else None)
    keep = _around_spikes(count, spikes, around)
    buckets = _buckets(count, limit - len(keep))
    size = buckets[0][1]
    whole = count // size  # buckets of `size` points; the last may be shorter
    grads = points.grads
    plain = ((points.flags & 1) == 1) & ~np.isnan(grads)
    if whole:
        block = grads[: whole * size].reshape(whole, size)
        clean = plain[: whole * size].reshape(whole, size).all(axis=1)
        lowest = block.argmin(axis=1) + np.arange(whole) * size
        highest = size - 1 - block[:, ::-1].argmax(axis=1) + np.arange(whole) * size
        keep.update(lowest[clean].tolist())
        keep.update(highest[clean].tolist())
        odd = np.flatnonzero(~clean).tolist()
    else:
        odd = []
    rest = [(b * size, size) for b in odd] + ([(whole * size, count - whole * size)] if whole * size < count else [])
    for start, length in rest:
        bucket = range(start, start + length)
        _keep_extremes(points.points(np.arange(start, start + length)), range(length), found := set())
        keep.update(bucket.start + i for i in found)
    return keep
