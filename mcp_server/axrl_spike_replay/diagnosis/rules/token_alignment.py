"""A rank whose tokens sit off from its stored per-token fields: one offset explains every stored input that is off.

Where a rank's stored old and rollout log-probs sit off the policy (and so, often, its recorded routes off the
model's own routing), each reads as its own broken input (`stale_old_logprobs`, `engine_mismatch`,
`routing_payload`). When they agree with one another, they may all be right for tokens the batch no longer holds at
their positions: a batch tokenized with the BOS twice, a collator that drops or adds a token, holds its tokens one
position on from the log-probs, masks and routes taken on the rollout's tokens. The replay tries the rank's tokens
moved by ±1 and ±2 positions (`replay.analyses.step_evidence_forward.realigned`); an offset that brings at least two
of the stored log-prob signals back onto the policy (each to `ALIGNED` of its distance as stored or less) and none
further off names the misalignment (`mask_misalignment`, the rank and the offset). The per-input causes on that rank
become its symptoms, under 0.8 (`SYMPTOM`), saying so; its experiment leaves the rank out. Streamed model evidence
does not try offsets (a whole-model replay's forwards): there the rule reads nothing."""

from __future__ import annotations

from dataclasses import dataclass

from axrl_spike_replay.diagnosis.rules.causes import Cause, Evidence, Experiment

ALIGNED = 0.25  # a signal back on the policy: its mean |Δ| at the offset this share of it as stored, or less
STRENGTH = 0.95  # one offset explains two stored inputs or more
SYMPTOM = 0.6  # the most a per-input cause of that rank keeps
SYMPTOMS = ("stale_old_logprobs", "engine_mismatch", "bad_ref_logprobs", "routing_payload")
NAMES = {"old": "old", "rollout": "rollout", "ref": "reference"}


@dataclass
class Offset:
    """One rank's tokens `offset` positions off its stored fields: per signal it brings back, (as stored, at the
    offset) mean |Δ|."""

    rank: int
    offset: int
    signals: dict[str, tuple[float, float]]


def offsets(ev: Evidence) -> list[Offset]:
    """The ranks whose stored log-probs one offset brings back onto the policy (module doc)."""
    if ev.reading is None:
        return []
    found: list[Offset] = []
    for rank, by_signal in sorted(ev.reading.shifted.items()):
        best: Offset | None = None
        keys = {k for _, by in by_signal.values() for k in by}
        for key in sorted(keys):
            back = {
                s: (base, by[key]) for s, (base, by) in by_signal.items() if key in by and by[key] <= ALIGNED * base
            }
            worse = any(key in by and by[key] > base for base, by in by_signal.values())
            if len(back) >= 2 and not worse and (best is None or len(back) > len(best.signals)):
                best = Offset(rank, int(key), back)
        if best is not None:
            found.append(best)
    return found


def token_misalignment(ev: Evidence) -> Cause | None:
    """A rank's tokens one offset off its stored per-token fields (module doc); None where no offset explains them."""
    found = offsets(ev)
    if not found:
        return None
    ranks = [o.rank for o in found]
    where = ",".join(str(r) for r in ranks)
    evidence = [
        f"rank {o.rank}'s tokens moved by {o.offset:+d} position{'s' if abs(o.offset) > 1 else ''} bring its stored "
        + ", ".join(f"{NAMES[s]} log-probs from {a:.3g} to {b:.3g} nats" for s, (a, b) in sorted(o.signals.items()))
        + " (mean |log π - stored| on loss tokens) back onto the policy: its tokens sit "
        f"{abs(o.offset)} position{'s' if abs(o.offset) > 1 else ''} off the log-probs, masks and routes it stores "
        "(a token added or dropped at tokenization), not each stored input broken on its own"
        for o in found
    ]
    return Cause(
        "mask_misalignment",
        f"tokens off their stored log-probs, masks and routes on rank {where}",
        STRENGTH,
        evidence,
        {"offsets": {o.rank: o.offset for o in found}, "signals": {o.rank: o.signals for o in found}},
        [
            Experiment(
                f"drop_ranks={where}",
                f"leaves rank {where}'s misaligned batch out: if the spike goes, it carries it",
                True,
                refutes="the spike stays within 20 % of the baseline",
            )
        ],
        ranks=ranks,
        term="policy",
    )


def symptoms_of_alignment(found: list[Cause], ev: Evidence) -> None:
    """The per-input causes confined to the misaligned ranks set under the misalignment (`SYMPTOM` at most), saying
    so."""
    cause = next((c for c in found if c.family == "mask_misalignment" and "offsets" in c.figures), None)
    if cause is None:
        return
    ranks = set(cause.ranks)
    for other in found:
        if other.family not in SYMPTOMS or not other.ranks or not set(other.ranks) <= ranks:
            continue
        other.strength = min(other.strength, SYMPTOM)
        other.evidence.append(
            f"rank {','.join(str(r) for r in other.ranks)}'s tokens sit off its stored per-token fields "
            "(mask_misalignment): this input reads off as a symptom of that offset"
        )
