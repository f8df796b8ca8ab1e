"""What the causes that name a stored signal or a rank share: which signals the run's loss reads, the loss channel's
sentences, the drop-a-rank lever, and the cap for a signal the loss does not read.

A family whose signal does not enter the run's loss (old log-probs under a rollout-based ratio without truncated IS,
a reference with `kl_coef` 0, recorded routes without routing replay) is capped at LIKELY (`not_in_loss`): it is out
of line, but cannot be what the gradient carries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from axrl_spike_replay.diagnosis.rules.causes import (
    LIKELY,
    LN2,
    LOSS_READS_LITTLE,
    Cause,
    Evidence,
    Experiment,
    is_finite,
    percent_text,
    top_carriers,
)

REFUTE_STAYS = "the spike stays within 20 % of the baseline"


def ranks_text(ranks: Sequence[int]) -> str:
    """The ranks as the levers write them (`0,3`)."""
    return ",".join(str(r) for r in ranks)


def base_signal(ev: Evidence) -> str:
    """The stored log-probs the run's ratio is taken against (old unless the loss config says rollout)."""
    return ev.loss.is_base_logprobs if ev.loss is not None else "old"


def loss_uses(ev: Evidence, signal: str) -> bool:
    """Whether a stored log-prob signal enters the run's loss (unknown config: assumed it does)."""
    loss = ev.loss
    if loss is None:
        return True
    if signal == "old":
        return loss.is_base_logprobs == "old" or loss.mismatch_token_clip_max is not None
    if signal == "rollout":
        return (
            loss.is_base_logprobs == "rollout"
            or loss.mismatch_token_clip_max is not None
            or loss.rollout_is is not None
            or loss.rollout_rs is not None
        )
    return bool(loss.kl_coef)


def replays_routes(ev: Evidence) -> bool:
    """Whether the run replays recorded routes (unknown config: assumed it does)."""
    return ev.routing is None or ev.routing.replay != "off"


def channel_lines(ev: Evidence, ranks: Sequence[int]) -> tuple[str | None, list[str]]:
    """(the carrying term, sentences on the channel for `ranks`)."""
    c = ev.channel
    if c is None or not c.terms:
        return None, []
    carrier = c.carrier
    if carrier is None:
        return None, []
    lines = [
        "the loss terms' shares of ‖g‖²-projection: "
        + ", ".join(f"{t.term} {t.share:.3g}" for t in sorted(c.terms, key=lambda t: -abs(t.share)))
    ]
    for r in ranks:
        parts = [(t.term, x.share) for t in c.terms for x in t.ranks if x.rank == r]
        if parts:
            lines.append(f"rank {r}'s terms carry " + ", ".join(f"{t} {s:.3g}" for t, s in parts) + " of it")
    tokens = [t for t in carrier.top_tokens if not ranks or t["rank"] in ranks][:3]
    if tokens:
        lines.append(
            f"the {carrier.term} term pulls hardest on "
            + ", ".join(f"rank {t['rank']} sample {t['sample']} position {t['position']}" for t in tokens)
        )
    return carrier.term, lines


def rank_share(ev: Evidence, ranks: Sequence[int]) -> float | None:
    """The share of the gradient the named ranks' terms carry (channel), None without it."""
    if ev.channel is None:
        return None
    return math.fsum(x.share for t in ev.channel.terms for x in t.ranks if x.rank in ranks)


def off_static(ev: Evidence) -> dict[int, float]:
    """Per rank, the share of samples whose max |log(π_old/π_rollout)| leaves [ln 0.5, ln 2] (no model)."""
    a = ev.analysis
    if not a.ratio_old_vs_rollout.get("available"):
        return {}
    by: dict[int, list[float]] = {}
    for row in a.samples["rows"]:
        v = row["max_abs_log_ratio_old_vs_rollout"]
        if row["loss_tokens"] and is_finite(v):
            by.setdefault(row["rank"], []).append(v)
    return {r: sum(v > LN2 for v in vs) / len(vs) for r, vs in by.items() if vs}


def static_figures(ev: Evidence) -> tuple[float, float] | None:
    """(max |log(π_old/π_rollout)|, share of loss tokens outside [0.5, 2]) from the batch, None without them."""
    from axrl_spike_replay.diagnosis.rules.causes import finite_fraction_outside

    a = ev.analysis
    if not a.ratio_old_vs_rollout.get("available"):
        return None
    outside = finite_fraction_outside(a.ratio_old_vs_rollout)
    if outside is None:
        return None
    return a.ratio_old_vs_rollout["abs_log_ratio"].get("max") or 0.0, outside


def carried_lines(ev: Evidence, signal: str, ranks: Sequence[int] = ()) -> list[str]:
    """The samples carrying most of ‖g‖ (attribution), each with how far its stored `signal` is from the replay."""
    if ev.reading is None:
        return []
    by = ev.reading.levels.get(signal, {})
    lines = []
    for s in top_carriers(ev.attribution):
        if ranks and s.rank not in ranks:
            continue
        lv = by.get(s.rank)
        pair = lv.current_pair if lv is not None else None
        peaks = pair.samples_max_abs if pair is not None else []
        peak = peaks[s.sample] if s.sample < len(peaks) else None
        if peak is not None and peak > LN2:
            lines.append(
                f"rank {s.rank} sample {s.sample} carries {percent_text(s.share)} of ‖g‖; "
                f"its tokens' |log π - log π_{signal}| "
                f"up to {peak:.3g}"
            )
    return lines


def not_in_loss(cause: Cause, what: str, why: str) -> None:
    """Cap `cause` below LIKELY: `what` does not enter this run's loss, for `why`."""
    cause.strength = min(cause.strength, LIKELY - 0.05)
    cause.figures[LOSS_READS_LITTLE] = True
    cause.evidence.append(
        f"{what} do not enter this run's loss ({why}): out of line, but not what the gradient carries"
    )


def drop_ranks(ranks: Sequence[int], what: str) -> Experiment:
    """The lever that leaves `ranks`' samples out, to test that `what` is on them."""
    return Experiment(
        f"drop_ranks={ranks_text(ranks)}",
        f"leaves rank {ranks_text(ranks)}'s samples out: if the spike goes, {what} is on that rank",
        True,
        refutes=REFUTE_STAYS,
    )


def strongest(*found: Cause | None) -> Cause | None:
    """The strongest of the causes found (None when none)."""
    return max((c for c in found if c is not None), key=lambda c: c.strength, default=None)


def kl_levers(ev: Evidence) -> list[Experiment]:
    """The KL term's levers (verl's estimators and clamp), for a cause whose gradient the KL term carries."""
    estimator = ev.loss.kl_estimator if ev.loss is not None else "k3"
    return [
        Experiment(
            "kl_estimator=k2" if estimator not in ("k2", "mse") else "kl_estimator=k1",
            "a KL estimator whose gradient grows at most linearly in log π - log π_ref",
            refutes=REFUTE_STAYS,
        ),
        Experiment("kl_clamp=10", "bounds each token's KL estimate (verl clamps its k3 at 10)", refutes=REFUTE_STAYS),
        Experiment("kl_coef=0", "removes the KL term: if the spike goes, the KL term carries it", True, REFUTE_STAYS),
    ]
