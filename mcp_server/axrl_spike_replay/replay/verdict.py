"""Verdicts: did the baseline reproduce the spike, and what did a mitigation do to it.

A baseline replay is `reproduced` when its grad norm matches the recorded one within the layout's
tolerance. A mitigated replay is judged against the baseline replay of the same snapshot at the
same layout: `cleared` when the spike ratio (grad norm / the snapshot's median norm) is under the
detector threshold, `partial` when the grad norm is at most half the baseline's but still above,
`worse` when it grew by more than WORSE_MARGIN (or is not finite), `no_effect` otherwise.
"""

from __future__ import annotations

import math

from axrl_spike_replay.snapshot.metadata import DetectorSpec

TOLERANCE = {"full": 1e-6, "reduced": 1e-5}
CUDA_TOLERANCE = 1e-4  # a GPU replay of a CPU-recorded step: different kernels and summation order
PARTIAL_FACTOR = 0.5  # `partial`: grad norm at most this fraction of the baseline's
WORSE_MARGIN = 0.05  # `worse`: grad norm more than 5% above the baseline's
DEFAULT_RATIO_THRESHOLD = 5.0  # for detectors whose own statistic is not a ratio to the median


def tolerance(fidelity: str, device: str = "cpu") -> float:
    """The rel_diff a baseline replay may show and still count as `reproduced`."""
    base = TOLERANCE.get(fidelity, TOLERANCE["reduced"])
    return max(base, CUDA_TOLERANCE) if device.startswith("cuda") else base


def ratio_threshold(detector: DetectorSpec) -> float:
    """The spike-ratio threshold a verdict compares against (the detector's, when it is a median ratio)."""
    return float(detector.threshold) if detector.kind == "median_ratio" else DEFAULT_RATIO_THRESHOLD


def rel_diff(value: float | None, recorded: float) -> float | None:
    """|value - recorded| / |recorded| (None when either is missing or not finite)."""
    if value is None or not math.isfinite(value) or not math.isfinite(recorded) or recorded == 0:
        return None
    return abs(value - recorded) / abs(recorded)


def baseline_verdict(grad_norm: float, recorded: float, tol: float) -> str:
    """`reproduced` when the replayed grad norm matches the recorded one within `tol`, else `not_reproduced`."""
    if not math.isfinite(recorded):
        return "reproduced" if not math.isfinite(grad_norm) else "not_reproduced"
    diff = rel_diff(grad_norm, recorded)
    return "reproduced" if diff is not None and diff <= tol else "not_reproduced"


def mitigation_verdict(grad_norm: float, baseline_grad_norm: float, median_norm: float, threshold: float) -> str:
    """`cleared`, `partial`, `no_effect` or `worse` for a mitigated replay against its baseline."""
    if not math.isfinite(grad_norm):
        return "worse" if math.isfinite(baseline_grad_norm) else "no_effect"
    if median_norm > 0 and grad_norm / median_norm < threshold:
        return "cleared"
    if not math.isfinite(baseline_grad_norm):
        return "partial"
    if grad_norm <= PARTIAL_FACTOR * baseline_grad_norm:
        return "partial"
    if grad_norm > (1.0 + WORSE_MARGIN) * baseline_grad_norm:
        return "worse"
    return "no_effect"
