"""A step that is not finite though every stored input is: which finite input's extreme values overflow.

The loss exponentiates log-prob differences: the importance ratio exp(log π - log π_base) against the old or the
rollout log-probs, the truncated-IS weight exp(log π_old - log π_rollout), k3's exp(log π_ref - log π). A stored
log-prob that sits more than ln(float32 max) ≈ 88.7 nats from the one it is set against makes that exp() inf, and
the gradient NaN, from values that are each finite. There the non-finite grad norm is the symptom, not the cause:
the cause is the input whose distance overflows, on the ranks where it does.

`overflow_driver` finds it: per rank, each stored log-prob signal against the replay at the snapshot's weights (the
policy's log-prob the loss computes; model evidence) or, without the replay, the stored old against the stored
rollout log-probs, past EXP_OVERFLOW. `symptom_of_overflow` then sets the non-finite cause under the cause that
reads that input (the family of the signal), names the driver in both, and gives the non-finite cause the
experiments that test the driver: the rank's inputs left out, the samples past the bound left out, and the
log-ratio clamped before exp()."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from axrl_spike_replay.diagnosis.rules.causes import (
    LIKELY,
    NON_FINITE_INPUTS,
    Cause,
    Evidence,
    Experiment,
    is_finite,
    log_ratio_clip,
    sample_pairs,
)

EXP_OVERFLOW = math.log(3.4028234663852886e38)  # exp() of a float32 past this is inf (about 88.72)
BELOW = 0.2  # how far under its driver's strength the symptom is set
# the cause family that reads each stored signal
SIGNAL_FAMILY = {"rollout": "engine_mismatch", "old": "stale_old_logprobs", "ref": "bad_ref_logprobs"}
SIGNAL_NAME = {
    "rollout": "rollout engine's log-probs",
    "old": "old log-probs",
    "ref": "reference log-probs",
    "old_vs_rollout": "old against rollout log-probs",
}


@dataclass
class Overflow:
    """The finite input whose extreme values overflow exp(): `signal` (old, rollout, ref against the replay, or
    old_vs_rollout, stored against stored), its peak |Δ| per rank past EXP_OVERFLOW, and the samples there."""

    signal: str
    family: str | None  # None: the stored pair alone cannot tell which of the two is off
    peaks: dict[int, float]
    samples: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.peaks)

    def sentence(self) -> str:
        where = ", ".join(f"rank {r} up to {p:.4g} nats" for r, p in sorted(self.peaks.items()))
        against = "one another" if self.signal == "old_vs_rollout" else "the policy's (the replay at its weights)"
        return (
            f"every stored input is finite; the {SIGNAL_NAME[self.signal]} sit far from {against} ({where}), past "
            f"{EXP_OVERFLOW:.1f}, where exp() of the log-ratio overflows float32: the ratio is inf there and the "
            "gradient not finite"
        )


def _from_reading(ev: Evidence) -> Overflow | None:
    if ev.reading is None:
        return None
    found: list[Overflow] = []
    for signal, by_rank in ev.reading.levels.items():
        if signal not in SIGNAL_FAMILY:
            continue
        peaks, samples = {}, []
        for rank, lv in by_rank.items():
            pair = lv.current_pair
            if pair is None or not is_finite(pair.max_abs) or pair.max_abs < EXP_OVERFLOW:
                continue
            peaks[rank] = pair.max_abs
            samples += [(rank, i) for i, p in enumerate(pair.samples_max_abs) if p is not None and p >= EXP_OVERFLOW]
        if peaks:
            found.append(Overflow(signal, SIGNAL_FAMILY[signal], peaks, sorted(samples)))
    return max(found, key=lambda o: max(o.peaks.values()), default=None)


def _from_batch(ev: Evidence) -> Overflow | None:
    rows = [r for r in ev.analysis.samples["rows"] if r["loss_tokens"]]
    past = [r for r in rows if is_finite(p := r.get("max_abs_log_ratio_old_vs_rollout")) and p >= EXP_OVERFLOW]
    if not past:
        return None
    peaks: dict[int, float] = {}
    for r in past:
        peaks[r["rank"]] = max(peaks.get(r["rank"], 0.0), r["max_abs_log_ratio_old_vs_rollout"])
    return Overflow("old_vs_rollout", None, peaks, sorted((r["rank"], r["sample"]) for r in past))


def overflow_driver(ev: Evidence) -> Overflow | None:
    """The finite stored input whose distance overflows exp() (module doc); None where none does."""
    return _from_reading(ev) or _from_batch(ev)


def symptom_of_overflow(found: list[Cause], ev: Evidence) -> None:
    """A non-finite recorded step whose stored inputs are all finite, with a driver (`overflow_driver`): the
    non-finite cause is set under the driver's cause (at most NON_FINITE_INPUTS, BELOW under it), both name the
    driver, and the non-finite cause's experiments test it."""
    symptom = next((c for c in found if c.family == "non_finite"), None)
    if symptom is None or symptom.strength < 1.0 or not symptom.figures.get("inputs_finite"):
        return
    driver = overflow_driver(ev)
    if driver is None:
        return
    cause = next((c for c in found if driver.family is not None and c.family == driver.family), None)
    top = cause.strength if cause is not None else 1.0
    symptom.strength = max(LIKELY, min(NON_FINITE_INPUTS, top - BELOW))
    said = driver.sentence()
    read = f" ({driver.family} reads it)" if driver.family else ""
    symptom.evidence.append(f"{said}: the non-finite step is the symptom of that input{read}")
    symptom.figures["overflow"] = {"signal": driver.signal, "peaks": driver.peaks, "bound": EXP_OVERFLOW}
    symptom.ranks = driver.ranks
    where = ",".join(str(r) for r in driver.ranks)
    tests = [
        Experiment(
            f"drop_ranks={where}",
            f"leaves out rank {where}'s inputs: if the step is finite without them, their {SIGNAL_NAME[driver.signal]} "
            "drive the overflow",
            True,
            refutes="the step stays non-finite without them",
        )
    ]
    rows = ev.analysis.samples["rows"]
    whole = {(r["rank"], r["sample"]) for r in rows if r["rank"] in driver.peaks and r["loss_tokens"]}
    # a few samples (every one of the ranks is what `drop_ranks` tests)
    if driver.samples and len(driver.samples) * 2 <= len(rows) and set(driver.samples) != whole:
        tests.append(
            Experiment(
                f"drop_samples={sample_pairs(driver.samples)}",
                f"leaves out the samples whose {SIGNAL_NAME[driver.signal]} pass the bound: if the step is finite "
                "without them, those values drive the overflow",
                True,
                refutes="the step stays non-finite without them",
            )
        )
    tests.append(log_ratio_clip())  # a log-prob drives the overflow: the clamp before exp() reaches it
    have = {e.mitigation for e in symptom.experiments}
    symptom.experiments = [*symptom.experiments, *(t for t in tests if t.mitigation not in have)]
    if cause is not None:
        cause.evidence.append(f"{said}: this input drives the step's non-finite grad norm")
        cause.figures["overflow"] = symptom.figures["overflow"]
