"""Verdicts: did the baseline reproduce the spike, and what did a mitigation do to it.

A baseline replay is `reproduced` when its grad norm matches the recorded one within the layout's
tolerance. A hypothesis replay (loss settings scoped to ranks, `experiment.mitigation.rank_scope`) is judged the same
way, against the recording, and also rank by rank: each rank's replayed loss against its recorded one.

A mitigated replay is judged against the baseline replay of the same snapshot at the same layout, and only
when that baseline is itself a spike (its ratio to the snapshot's median norm at or above the threshold):
otherwise the verdict is `baseline_not_a_spike` (nothing to clear; a detector threshold raised in the
metadata cannot make a no-op look like a fix). Against a spike baseline: `worse` when the grad norm grew by
more than WORSE_MARGIN (or is not finite), `no_effect` when it is not measurably (MEASURABLE_DROP) below the
baseline's, else `cleared` when the spike ratio is under the threshold, `partial` when the grad norm is at
most half the baseline's but still above, `no_effect` otherwise.

The threshold is the snapshot detector's (a median ratio; DEFAULT_RATIO_THRESHOLD for other detectors)
unless the user gives their own (`--clear-threshold X`, MCP `clear_threshold`): then X decides both
whether the baseline is a spike and whether a mitigation cleared it. Every result records the numbers
it was judged by (`verdict_basis`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.metadata import DetectorSpec
from axrl_spike_replay.vocabulary import WRITABLE_VERDICTS, Fidelity, Verdict

TOLERANCE = {Fidelity.FULL: 1e-6, Fidelity.REDUCED: 1e-5}
CUDA_TOLERANCE = 1e-4  # a GPU replay of a CPU-recorded step: different kernels and summation order
# a step recorded in a 16-bit compute dtype: its grad norm is known to about this much (bfloat16 keeps 8 bits)
PRECISION_TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3}
SPREAD_FACTOR = 3.0  # a replay's repeats that differ (kernels not bit-deterministic): this many times their range
PARTIAL_FACTOR = 0.5  # `partial`: grad norm at most this fraction of the baseline's
WORSE_MARGIN = 0.05  # `worse`: grad norm more than 5% above the baseline's
MEASURABLE_DROP = 0.01  # a mitigation must lower the grad norm by at least 1% to count at all
DEFAULT_RATIO_THRESHOLD = 5.0  # for detectors whose own statistic is not a ratio to the median (zscore)


def tolerance(fidelity: Fidelity, device: str = "cpu") -> float:
    """The rel_diff a baseline replay may show and still count as `reproduced`."""
    base = TOLERANCE.get(fidelity, TOLERANCE[Fidelity.REDUCED])
    return max(base, CUDA_TOLERANCE) if device.startswith("cuda") else base


def tolerance_rule(
    fidelity: Fidelity, device: str = "cpu", compute_dtype: str = "float32", repeats: Sequence[float] = ()
) -> tuple[float, str]:
    """(the rel_diff a baseline may show and count as `reproduced`, the rule that set it), the loosest that applies:

    - the layout's (`tolerance`): float32 kernels on CPU give the same numbers run after run;
    - the GPU's: its kernels sum in another order than the recording's, and some (atomics in the backward of
      attention and scatter) differ from run to run;
    - the recorded precision's: a bfloat16 or float16 step is rounded at every op, so its grad norm is known only to
      that precision (`PRECISION_TOLERANCE`);
    - the replay's own spread: over `repeats` (the grad norm of each repeat of one config), SPREAD_FACTOR times its
      relative range, where the kernels are not bit-deterministic and that range is the larger."""
    value = tolerance(fidelity, device)
    rule = f"the {fidelity} fidelity layout's"
    if device.startswith("cuda") and value == CUDA_TOLERANCE:
        rule = "GPU kernels' (another summation order than the recording's)"
    precision = PRECISION_TOLERANCE.get(compute_dtype, 0.0)
    if precision > value:
        value, rule = precision, f"the recorded precision's ({compute_dtype})"
    finite = [r for r in repeats if math.isfinite(r)]
    if len(finite) > 1 and sum(finite) > 0:
        spread = (max(finite) - min(finite)) / (sum(finite) / len(finite))
        if SPREAD_FACTOR * spread > value:
            value = SPREAD_FACTOR * spread
            rule = f"the replay's own spread over {len(finite)} repeats ({spread:.3g} relative, x{SPREAD_FACTOR:g})"
    return value, rule


def ratio_threshold(detector: DetectorSpec) -> float:
    """The spike-ratio threshold a verdict compares against (the detector's, when it is a median ratio).

    A z-score detector's threshold is in standard deviations, not a ratio: its verdicts use
    DEFAULT_RATIO_THRESHOLD. SnapshotError when a median-ratio threshold is not a finite number > 0.
    """
    if detector.kind != "median_ratio":
        return DEFAULT_RATIO_THRESHOLD
    value = detector.threshold
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SnapshotError(f"detector threshold {shown(value, 60)} is not a finite number > 0")
    return float(value)


def verdict_threshold(detector: DetectorSpec, clear_threshold: float | None = None) -> tuple[float, str]:
    """(the spike-ratio threshold verdicts use, where it came from): the user's `clear_threshold` when given,
    else the snapshot detector's (`ratio_threshold`)."""
    if clear_threshold is not None:
        return float(clear_threshold), "clear_threshold"
    return ratio_threshold(detector), "detector" if detector.kind == "median_ratio" else "default"


@dataclass
class MitigatedBasis:
    """What a mitigated replay's verdict was judged by: its ratio and the baseline's against the threshold, the
    change against the baseline, the margins of `partial`, `no_effect` and `worse`, and the rule in words."""

    threshold: float
    threshold_source: str  # detector, clear_threshold or default (`threshold_label`)
    detector_threshold: float | None
    ratio_to_median: float | None
    baseline_ratio_to_median: float | None
    change_vs_baseline: float | None
    partial_factor: float = PARTIAL_FACTOR
    measurable_drop: float = MEASURABLE_DROP
    worse_margin: float = WORSE_MARGIN
    rule: str = ""
    # False for a baseline whose norm was NaN or inf: a result file keeps that norm as null (`jsonable`), and a
    # missing baseline must not read as one that was no spike
    baseline_finite: bool | None = None


@dataclass
class BaselineBasis:
    """What a baseline's verdict was judged by: its rel diff against the recording within a tolerance, and why that
    tolerance (`tolerance_rule`)."""

    rel_diff: float | None
    tolerance: float
    tolerance_rule: str
    rule: str
    threshold: float
    threshold_source: str


@dataclass
class HypothesisBasis:
    """What a hypothesis replay's verdict was judged by: as a baseline's, and each recorded rank loss against the
    replayed one (`rank_losses`: rank, recorded_loss, replayed_loss, abs_diff when both are known, matches)."""

    rel_diff: float | None
    tolerance: float
    rank_losses: list[dict[str, Any]] = field(default_factory=list)
    rule: str = ""
    threshold: float | None = None
    threshold_source: str | None = None


VerdictBasis = MitigatedBasis | BaselineBasis | HypothesisBasis


def basis_from_json(doc: Mapping[str, Any]) -> VerdictBasis | dict[str, Any]:
    """The basis a result file keeps, typed by its kind when it holds exactly that kind's keys in their order (so
    it is written back as read); a shape of an earlier version stays as it was read."""
    for kind in (HypothesisBasis, BaselineBasis, MitigatedBasis):
        if list(doc) == list(kind.__dataclass_fields__):
            return kind(**dict(doc))
    return dict(doc)


def basis_field(basis: VerdictBasis | Mapping[str, Any] | None, name: str) -> Any:
    """Field `name` of a verdict basis, typed or as an earlier version wrote it (None when it has none)."""
    return basis.get(name) if isinstance(basis, Mapping) else getattr(basis, name, None)


def verdict_basis(
    grad_norm: float | None,
    baseline_grad_norm: float | None,
    median_norm: float,
    threshold: float,
    source: str,
    detector_threshold: float | None,
) -> MitigatedBasis:
    """The numbers a mitigated verdict is judged by, and the rule, for `replay_result.json`."""
    return MitigatedBasis(
        threshold=threshold,
        threshold_source=source,
        detector_threshold=detector_threshold,
        ratio_to_median=ratio_to_median(grad_norm, median_norm),
        baseline_ratio_to_median=ratio_to_median(baseline_grad_norm, median_norm),
        change_vs_baseline=grad_norm / baseline_grad_norm - 1.0
        if grad_norm is not None and baseline_grad_norm
        else None,
        rule=RULE,
        baseline_finite=None if baseline_grad_norm is None else math.isfinite(baseline_grad_norm),
    )


def threshold_label(basis: VerdictBasis | Mapping[str, Any] | None) -> str:
    """What the threshold a result was judged by is, from its `verdict_basis`: the detector's, a clear threshold
    given for the replay, or the default ratio threshold; plain "threshold" when the result does not say."""
    source = basis_field(basis, "threshold_source")
    labels = {
        "detector": "detector threshold",
        "clear_threshold": "clear threshold given for the replay",
        "default": "default ratio threshold (the detector's is no ratio to the median)",
    }
    return labels.get(source, "threshold") if isinstance(source, str) else "threshold"


RULE = (
    f"baseline_not_a_spike when the baseline's ratio to the median is under the threshold; worse when the grad norm "
    f"grew by more than {WORSE_MARGIN:.0%} (or is not finite); no_effect when it is not at least "
    f"{MEASURABLE_DROP:.0%} below the baseline's; cleared when its ratio to the median is under the threshold; "
    f"partial when it is still at or above the threshold but at most {PARTIAL_FACTOR:g} x the baseline's grad "
    "norm; no_effect otherwise"
)


def ratio_to_median(grad_norm: float | None, median_norm: float) -> float | None:
    """grad_norm / median_norm; inf when the median is not positive (as the detector counts it); None without a norm."""
    if grad_norm is None:
        return None
    if not math.isfinite(median_norm) or median_norm <= 0:
        return math.inf
    return grad_norm / median_norm


def is_spike(grad_norm: float | None, median_norm: float, threshold: float) -> bool:
    """True when `grad_norm` is a spike here: not finite, or its ratio to the median at or above `threshold`."""
    if grad_norm is None:
        return False
    if not math.isfinite(grad_norm):
        return True
    ratio = ratio_to_median(grad_norm, median_norm)
    return ratio is not None and ratio >= threshold


def rel_diff(value: float | None, recorded: float) -> float | None:
    """|value - recorded| / |recorded| (None when either is missing or not finite)."""
    if value is None or not math.isfinite(value) or not math.isfinite(recorded) or recorded == 0:
        return None
    return abs(value - recorded) / abs(recorded)


def baseline_verdict(grad_norm: float, recorded: float, tol: float) -> Verdict:
    """`reproduced` when the replayed grad norm matches the recorded one within `tol`, else `not_reproduced`."""
    if not math.isfinite(recorded):
        return Verdict.REPRODUCED if not math.isfinite(grad_norm) else Verdict.NOT_REPRODUCED
    diff = rel_diff(grad_norm, recorded)
    return Verdict.REPRODUCED if diff is not None and diff <= tol else Verdict.NOT_REPRODUCED


HYPOTHESIS_RULE = (
    "reproduced under the hypothesis when |grad_norm - recorded| / recorded <= tolerance and every rank's replayed "
    "loss matches its recorded one (|replayed - recorded| <= tolerance * max(1, |recorded|)); not_reproduced otherwise"
)


def hypothesis_verdict(
    grad_norm: float, recorded: float, tol: float, rank_losses: Mapping[int, tuple[float | None, float | None]]
) -> tuple[Verdict, HypothesisBasis]:
    """A hypothesis replay judged against the recording, as a baseline is, and also rank by rank: `reproduced` when
    its grad norm matches the recorded one within `tol` (`baseline_verdict`) and so does every rank's loss that was
    recorded (`rank_losses`: {rank: (recorded, replayed)}); the verdict and the numbers it was judged by."""
    verdict = baseline_verdict(grad_norm, recorded, tol)
    rows = []
    for rank, (was, now) in sorted(rank_losses.items()):
        if was is None or now is None:
            rows.append({"rank": rank, "recorded_loss": was, "replayed_loss": now, "matches": None})
            continue
        diff = abs(now - was)
        matches = math.isfinite(diff) and diff <= tol * max(1.0, abs(was))
        rows.append({"rank": rank, "recorded_loss": was, "replayed_loss": now, "abs_diff": diff, "matches": matches})
    if any(row["matches"] is False for row in rows):
        verdict = Verdict.NOT_REPRODUCED
    return verdict, HypothesisBasis(rel_diff(grad_norm, recorded), tol, rows, HYPOTHESIS_RULE)


def mitigation_verdict(grad_norm: float, baseline_grad_norm: float, median_norm: float, threshold: float) -> Verdict:
    """`cleared`, `partial`, `no_effect`, `worse` or `baseline_not_a_spike` for a mitigated replay vs its baseline."""
    if not math.isfinite(grad_norm):
        return Verdict.WORSE if math.isfinite(baseline_grad_norm) else Verdict.NO_EFFECT
    if math.isfinite(baseline_grad_norm) and grad_norm > (1.0 + WORSE_MARGIN) * baseline_grad_norm:
        return Verdict.WORSE
    if not is_spike(baseline_grad_norm, median_norm, threshold):
        return Verdict.BASELINE_NOT_A_SPIKE
    if math.isfinite(baseline_grad_norm) and grad_norm > (1.0 - MEASURABLE_DROP) * baseline_grad_norm:
        return Verdict.NO_EFFECT
    ratio = ratio_to_median(grad_norm, median_norm)
    if ratio is not None and ratio < threshold:
        return Verdict.CLEARED
    if not math.isfinite(baseline_grad_norm) or grad_norm <= PARTIAL_FACTOR * baseline_grad_norm:
        return Verdict.PARTIAL
    return Verdict.NO_EFFECT


def writable_problem(
    verdict: Verdict | str,
    grad_norm: float | None,
    baseline_grad_norm: float | None,
    median_norm: float | None,
    threshold: float | None,
) -> str | None:
    """Why a mitigated result cannot be written up (its verdict, or a baseline that was no spike), else None.

    Re-checks the figures, not only the stored verdict: a result written before baselines were
    checked may say `cleared` for a baseline that was never a spike.
    """
    if verdict not in WRITABLE_VERDICTS:
        return f"its verdict is {verdict!r}; only a 'cleared' or 'partial' attempt can be written up as a method"
    if baseline_grad_norm is None or median_norm is None or threshold is None:
        return "its result has no baseline grad norm, median or threshold to check the baseline was a spike"
    if not is_spike(baseline_grad_norm, median_norm, threshold):
        ratio = ratio_to_median(baseline_grad_norm, median_norm)
        return (
            f"its baseline was not a spike (ratio to median {ratio:.4g} is under the threshold {threshold:.4g}), "
            "so there was nothing to clear"
        )
    if grad_norm is None or (
        math.isfinite(baseline_grad_norm) and not grad_norm <= (1.0 - MEASURABLE_DROP) * baseline_grad_norm
    ):
        return f"its grad norm is not measurably below the baseline's {baseline_grad_norm:.6g}"
    return None
