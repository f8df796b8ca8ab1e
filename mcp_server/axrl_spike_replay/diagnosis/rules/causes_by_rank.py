"""Every cause held to the per-rank figures.

The per-rank figures `diagnose` has single out ranks in several ways: a rank whose local grad norm is far above the
others' (`SINGLE_NORM` times their median), a rank whose recorded loss or norms the replay does not give
(`reproduction`), a stored signal out of line on some ranks only with a witness on the others (`signal_reading`), a
rank whose terms carry most of the reduced gradient. When they do, a cause that names no rank (it claims every
rank), other ranks or more ranks is either scoped to the singled-out ones, where its family's broken part is a
rank's own (a stored signal, a batch, a value), or says why not and is weakened to `UNSCOPED`: a spread cause
cannot account for a spike the figures put on one rank. A cause a witness separates (strength 1.0) says so and keeps
its strength: it is a second broken part. `step_not_reproduced` is scoped by the record comparison itself, and a
cause that read the singled-out ranks and says it cannot tell its part is there (`NOT_TOLD`) is left as it is.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.diagnosis.rules.causes import LIKELY, Cause

SINGLE_NORM = 10.0  # a rank's local grad norm this many times the other ranks' median singles it out
SINGLE_SHARE = 0.8  # ... or its terms carrying this share of the reduced gradient (world size > 1)
UNSCOPED = 0.45  # the most a cause keeps that claims other ranks than the figures single out
NOT_TOLD = "rank_not_told"  # figures key of a cause that read the singled-out ranks and cannot tell its part is there
# families whose broken part belongs to a rank: scoped to the singled-out ranks when they named none
RANK_OWN = (
    "stale_old_logprobs",
    "bad_ref_logprobs",
    "routing_payload",
    "mask_misalignment",
    "one_rank_data",
    "non_finite",
    "outlier_advantage",
)
WHY_SPREAD = {
    "engine_mismatch": "an engine/trainer mismatch is the engine's on every rank; the rollout log-probs of the "
    "singled-out ranks are not further off than the others'",
    "negative_advantage_dominance": "the sign balance is the batch's over every rank",
    "natural_spike": "a hard batch spreads over the ranks",
    "step_not_reproduced": "every rank's record differs from the replay",
}


@dataclass
class Singled:
    """The ranks the per-rank figures single out, and the figures that do."""

    ranks: list[int] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


def singled_out(ev: Any, world: int) -> Singled:
    """The ranks the per-rank figures of `ev` (`causes.Evidence`) single out (none when they single out none)."""
    found: dict[int, list[str]] = {}
    grads = getattr(ev, "grads", None)
    if grads is not None and world > 1:
        local = {k.rank: k.local_grad_norm for k in grads.ranks if math.isfinite(k.local_grad_norm)}
        for rank, norm in local.items():
            others = [v for r, v in local.items() if r != rank]
            median = statistics.median(others) if others else 0.0
            if median > 0 and norm >= SINGLE_NORM * median:
                found.setdefault(rank, []).append(
                    f"rank {rank}'s local grad norm {norm:.4g} is {norm / median:.3g}x the other ranks' median "
                    f"{median:.4g}"
                )
    reproduced = getattr(ev, "reproduction", None)
    if reproduced is not None and reproduced.readings:
        differ = [r.rank for r in reproduced.readings if not r.matches]
        if differ and len(differ) < len(reproduced.readings):
            for rank in differ:
                found.setdefault(rank, []).append(f"rank {rank}'s recorded loss or norms are not the replay's")
    reading = getattr(ev, "reading", None)
    if reading is not None:
        for odd in reading.odd:
            if odd.separated and odd.ranks and len(odd.ranks) < world:
                for rank in odd.ranks:
                    found.setdefault(rank, []).append(f"the stored {odd.signal} signal is out of line on rank {rank}")
    channel = getattr(ev, "channel", None)
    if channel is not None and world > 1:
        shares: dict[int, float] = {}
        for term in channel.terms:
            for x in term.ranks:
                if math.isfinite(x.share):
                    shares[x.rank] = shares.get(x.rank, 0.0) + x.share
        for rank, share in shares.items():
            if share >= SINGLE_SHARE:
                found.setdefault(rank, []).append(f"rank {rank}'s terms carry {100 * share:.0f} % of the reduced norm")
    if len(found) >= world:
        return Singled()
    return Singled(sorted(found), [f for r in sorted(found) for f in found[r]])


def hold_to_ranks(found: list[Cause], singled: Singled) -> None:
    """Scope each likely cause to the singled-out ranks, or say why not and weaken it (module doc); in place."""
    if not singled.ranks:
        return
    where = ", ".join(str(r) for r in singled.ranks)
    figures = "; ".join(singled.figures[:4])
    for cause in found:
        if cause.strength < LIKELY or cause.family == "step_not_reproduced":  # its ranks are the record's own
            continue
        if cause.figures.get(NOT_TOLD):  # it read those ranks itself and says its part is not shown to be there
            continue
        inside = set(cause.ranks) & set(singled.ranks)
        if inside and cause.family in RANK_OWN and len(inside) < len(cause.ranks):
            left = sorted(set(cause.ranks) - inside)
            cause.ranks = sorted(inside)
            cause.evidence.append(
                f"scoped to rank {', '.join(map(str, cause.ranks))}: the per-rank figures single it out ({figures}), "
                f"not rank {', '.join(map(str, left))}"
            )
            continue
        if inside:
            continue
        if not cause.ranks and cause.family in RANK_OWN:
            cause.ranks = list(singled.ranks)
            cause.evidence.append(f"scoped to rank {where}: the per-rank figures single it out ({figures})")
            continue
        claim = f"ranks {', '.join(map(str, cause.ranks))}" if cause.ranks else "every rank"
        why = WHY_SPREAD.get(cause.family, "its evidence is not on those ranks")
        if cause.strength >= 1.0:  # a witness separates it: a second broken part beside the one on those ranks
            cause.evidence.append(
                f"the per-rank figures single out rank {where} ({figures}); this cause claims {claim} ({why}) and a "
                "witness separates it: a second broken part beside the one there"
            )
            continue
        cause.evidence.append(
            f"the per-rank figures single out rank {where} ({figures}); this cause claims {claim} ({why}), so it "
            "cannot account for the spike there"
        )
        cause.strength = min(cause.strength, UNSCOPED)
