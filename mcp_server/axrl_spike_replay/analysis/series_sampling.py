"""Down-sampling a long grad-norm series for output, keeping its spikes and their neighbourhoods exact.

A 1 M-iteration series is an 86 MB JSON document; people and programs reading `logs` want its shape and its
spikes. The sample keeps only real points (no averages): the first and last, every point within `around`
iterations (by position) of a spike, and the lowest and highest grad norm of each of a fixed number of
equal buckets, so the envelope of the curve (and any bump the detector did not flag) stays visible.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

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
    keep = {0, len(points) - 1}
    for iteration in spike_iterations:  # points are in iteration order: found by bisection, no index built
        at = bisect_left(points, iteration, key=_iteration)
        if at < len(points) and points[at]["iteration"] == iteration:
            keep.update(range(max(0, at - around), min(len(points), at + around + 1)))
    buckets = max(1, (limit - len(keep)) // 2)
    size = -(-len(points) // buckets)
    for start in range(0, len(points), size):
        bucket = range(start, min(len(points), start + size))
        norms = [(points[i]["grad_norm"], i) for i in bucket if points[i]["grad_norm"] is not None]
        if norms:
            keep.add(min(norms)[1])
            keep.add(max(norms)[1])
        else:
            keep.add(start)
    return [points[i] for i in sorted(keep)]
