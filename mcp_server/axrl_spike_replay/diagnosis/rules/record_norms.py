"""Which per-rank local grad norms a rank-singling cause may read: the recorded ones where the replay reproduces
them, the replay's where it does not.

A rank whose recorded per-parameter norms the replay of its stored inputs does not give (`reproduction`: the rank
differs) has a record that is not its data's step: the large local norm it records is the non-reproduction itself,
which `step_not_reproduced` explains. Read as "this rank's data carries the spike" it would be counted twice, and
wrongly where the rank's stored data replays to a normal step (a trainer that read other inputs than it stored).
There the replay's local norm of that rank, the step its stored data gives, is the figure to judge it by."""

from __future__ import annotations

import math
import statistics
from typing import Any

from axrl_spike_replay.diagnosis.rules.causes import Cause


def replayed_local_norms(ev: Any) -> dict[int, float]:
    """{rank: the replay's local grad norm of that rank's stored inputs (sqrt of the sum of its squared
    per-parameter norms)}, for the ranks the loss channel computed; {} without it."""
    channel = getattr(ev, "channel", None)
    if channel is None:
        return {}
    out: dict[int, float] = {}
    for row in channel.rank_param_norms:
        norms = channel.param_norms_of(int(row["rank"])) or {}
        out[int(row["rank"])] = math.sqrt(math.fsum(v * v for v in norms.values()))  # NaN where one is
    return out


def unreproduced_ranks(ev: Any) -> list[int]:
    """The ranks whose recorded figures (loss, per-parameter norms) the replay of their stored inputs does not give."""
    found = getattr(ev, "reproduction", None)
    if found is None:
        return []
    return sorted(r.rank for r in found.readings if not r.matches)


def judged_local_norms(ev: Any) -> tuple[dict[int, float], dict[int, float]]:
    """(each rank's local grad norm to judge it by, {rank: its recorded norm replaced}): the recorded local norms
    (`ev.grads`), with the replay's in place of each rank whose record the replay does not reproduce (module doc)."""
    local = {k.rank: k.local_grad_norm for k in ev.grads.ranks} if ev.grads is not None else {}
    replayed = replayed_local_norms(ev)
    replaced: dict[int, float] = {}
    for rank in unreproduced_ranks(ev):
        if rank in local and rank in replayed:
            replaced[rank] = local[rank]
            local[rank] = replayed[rank]
    return local, replaced


def replaced_note(replaced: dict[int, float], local: dict[int, float]) -> list[str]:
    """The evidence line saying which recorded local norms were not read, and why."""
    if not replaced:
        return []
    where = "; ".join(
        f"rank {r} recorded {v:.4g}, its stored inputs replay to {local[r]:.4g}" for r, v in replaced.items()
    )
    return [
        f"local grad norms judged on the replay where the record does not reproduce ({where}): a recorded norm the "
        "stored data does not give is the step not reproducing (that cause explains it), not that rank's data"
    ]


SINGLES_OUT = 3.0  # a rank's local norm this many times the other ranks' median singles it out (one_rank_data's)
RECORD_ONLY = 0.25  # under LIKELY: what a rank singled out by its unreproduced record alone is as its data's cause


def record_only(replaced: dict[int, float], local: dict[int, float]) -> Cause | None:
    """The weak reading left of "one rank's data" where only a rank's record, which its stored data does not
    replay to, singled it out (its recorded local norm SINGLES_OUT times the others' judged median): said, with the
    replay's figure, so a reader sees why it is not a finding; None when no such rank."""
    finite = {r: v for r, v in replaced.items() if math.isfinite(v) and math.isfinite(local[r])}
    if not finite:
        return None
    rank = max(finite, key=lambda r: finite[r])
    others = [v for r, v in local.items() if r != rank and math.isfinite(v)]
    base = statistics.median(others) if others else 0.0
    if not others or not base or replaced[rank] < SINGLES_OUT * base:
        return None
    return Cause(
        "one_rank_data",
        f"one rank's data (rank {rank})?",
        RECORD_ONLY,
        [
            f"rank {rank}'s recorded local grad norm {replaced[rank]:.4g} is {replaced[rank] / base:.3g}x the other "
            f"ranks' median {base:.4g}, but its stored inputs replay to {local[rank]:.4g} "
            f"({local[rank] / base:.3g}x): its data gives a normal step; the record is the step not reproducing on "
            "that rank (that cause explains it), not its data"
        ],
        {"rank": rank, "recorded_local_norm": replaced[rank], "replayed_local_norm": local[rank]},
        [],
        ranks=[rank],
    )
