"""The hypothesis replays that would prove why a step does not reproduce, built from the per-rank comparison
`diagnose` already has: each rank's recorded loss (its grad info) against the loss the replay computes for it at
the snapshot's weights (the loss channel's `rank_losses`), and each loss term's value in that rank's loss.

A rank whose recorded loss differs from its replayed one by D would give the recorded loss if the coefficient c of
one of its terms, whose value there is v (v is proportional to c), were c (v + D) / v instead; or if its whole loss
were scaled by recorded / replayed. Each is a hypothesis `NAME=VALUE@RANK` (`experiment.mitigation.rank_scope`). Every
one of them makes that rank's loss come out as recorded by construction, so the loss alone cannot tell them apart:
the replay under each does, by the recorded grad norm. The one the step reproduces under is the proof.

A value is written with the fewest significant digits whose rank loss, by the same linear reading, is still within
DIGITS_TOLERANCE of the recorded one (so a coefficient of 10.24 reads 10.24, not 10.240000013), and the suggestions
come shortest value first: a setting someone typed is a short number (40.96), a coincidence a long one (667.5628).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from axrl_spike_replay.diagnosis.rules.causes import Experiment
from axrl_spike_replay.experiment.step_evidence import LossChannel
from axrl_spike_replay.snapshot.consistency import LOSS_ABS_TOLERANCE, LOSS_TOLERANCE
from axrl_spike_replay.training.loss_config import LossConfig

# the loss term -> the mitigation that sets its coefficient (the policy term has none: `loss_scale` covers it)
TERM_KNOBS = {"aux": "aux_loss_coef", "z": "z_loss_coef", "kl": "kl_coef", "entropy": "entropy_coef"}
DIGITS_TOLERANCE = 1e-7  # relative: a suggested value reproduces the recorded rank loss this closely (fp32 loss)


@dataclass(frozen=True)
class RankMismatch:
    """A rank whose recorded loss the replay at the snapshot's weights does not give."""

    rank: int
    recorded: float
    replayed: float


def rank_mismatches(channel: LossChannel, recorded: dict[int, float | None]) -> list[RankMismatch]:
    """The ranks whose recorded loss differs from the replayed one by more than the consistency check allows."""
    out = []
    for rank, was in sorted(recorded.items()):
        now = channel.rank_loss(rank)
        if was is None or now is None or not (math.isfinite(was) and math.isfinite(now)):
            continue
        if not math.isclose(was, now, rel_tol=LOSS_TOLERANCE, abs_tol=LOSS_ABS_TOLERANCE):
            out.append(RankMismatch(rank, was, now))
    return out


def _shortest(value: float, fits: float, scale: float) -> str:
    """`value` with the fewest significant digits d for which |d-digit value - value| * scale stays within `fits`."""
    for digits in range(1, 18):
        text = f"{value:.{digits}g}"
        if abs(float(text) - value) * scale <= fits:
            return text
    return repr(value)


def loss_hypotheses(channel: LossChannel, mismatch: RankMismatch, loss: LossConfig) -> list[Experiment]:
    """The hypotheses that would make `mismatch.rank`'s loss come out as recorded, one loss setting each (see the
    module doc); `loss` is the run's loss settings."""
    rank, delta = mismatch.rank, mismatch.recorded - mismatch.replayed
    fits = DIGITS_TOLERANCE * max(1.0, abs(mismatch.recorded))
    refutes = "the grad norm (or another rank's loss) is not the recorded one: the rank computed something else"
    out: list[Experiment] = []
    for term in channel.terms:
        knob = TERM_KNOBS.get(term.term)
        value = next((r.value for r in term.ranks if r.rank == rank), None)
        coef = float(getattr(loss, knob)) if knob else 0.0
        if knob is None or value is None or not value or not coef:
            continue
        raw = value / coef  # the term per unit of its coefficient on this rank
        wanted = coef * (value + delta) / value
        if not math.isfinite(wanted) or wanted < 0:
            continue
        text = _shortest(wanted, fits, abs(raw))
        why = (
            f"rank {rank}'s recorded loss {mismatch.recorded:.7g} is what the replay gives ({mismatch.replayed:.7g}) "
            f"with its {term.term} term at {knob} {text} instead of the run's {coef:g}"
        )
        out.append(Experiment(f"{knob}={text}@{rank}", why, diagnostic_only=True, refutes=refutes))
    if mismatch.replayed and mismatch.recorded / mismatch.replayed > 0:
        scale = mismatch.recorded / mismatch.replayed
        text = _shortest(scale, fits, abs(mismatch.replayed))
        why = f"rank {rank}'s recorded loss is its replayed loss times {text} (a rank that scaled its whole loss)"
        out.append(Experiment(f"loss_scale={text}@{rank}", why, diagnostic_only=True, refutes=refutes))
    return sorted(out, key=lambda e: _digits(e.mitigation))  # stable: the terms' order among equals


def _digits(item: str) -> int:
    """The significant digits of a suggestion's value (`aux_loss_coef=40.96@1` -> 4)."""
    value = item.split("=", 1)[1].split("@", 1)[0]
    mantissa = value.lower().split("e", 1)[0]
    return len(mantissa.replace("-", "").replace(".", "").lstrip("0"))
