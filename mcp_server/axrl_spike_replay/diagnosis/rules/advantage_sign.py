"""A reading of the advantages as on another scale, joined to negative-advantage dominance where it is the same
symptom on the same ranks.

A rank whose advantages are all far below 0 reads two ways: its typical |advantage| is on another scale than the
other ranks' (`outlier_advantage`), and its negative advantages tip the batch's sign balance
(`negative_advantage_dominance`, scoped to the ranks that tip it). Where both name the same ranks and every
advantage there is below 0, the scale is the offset below 0, not a wider spread: one broken part, named once, as
the sign reading (its experiments, balancing the negatives or leaving those ranks out, are what test it), with the
scale reading's evidence and figures added. Advantages of both signs on those ranks keep the two apart.
"""

from __future__ import annotations

from axrl_spike_replay.diagnosis.rules.causes import Cause, Evidence, is_finite


def all_below_zero(ev: Evidence, ranks: list[int]) -> bool:
    """Whether every finite advantage of a sample with loss tokens on `ranks` is below 0 (and there is one)."""
    rows = [
        r
        for r in ev.analysis.samples.get("rows", [])
        if r["rank"] in ranks and r["loss_tokens"] and is_finite(r["advantage"])
    ]
    return bool(rows) and all(r["advantage"] < 0 for r in rows)


def join_by_sign(found: list[Cause], ev: Evidence) -> list[Cause]:
    """`found` with each advantage reading that names the ranks the negative-advantage cause names, every advantage
    there below 0, joined into that cause (module doc)."""
    sign = next((c for c in found if c.family == "negative_advantage_dominance" and c.ranks), None)
    if sign is None or "concentrated" in sign.figures or not all_below_zero(ev, sign.ranks):
        return found
    kept: list[Cause] = []
    for cause in found:
        if cause.family != "outlier_advantage" or sorted(cause.ranks) != sorted(sign.ranks):
            kept.append(cause)
            continue
        where = ",".join(str(r) for r in sign.ranks)
        sign.strength = max(sign.strength, cause.strength)
        sign.evidence.append(
            f"every advantage on rank {where} is below 0: the advantages' reading there ({cause.title}) is the same "
            "symptom, their offset below 0, not a wider spread"
        )
        sign.evidence += cause.evidence
        sign.figures["advantages"] = cause.figures
        known = {e.mitigation for e in sign.experiments}
        sign.experiments += [e for e in cause.experiments if e.mitigation not in known]
    return kept
