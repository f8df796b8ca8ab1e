"""The stored log-prob families: the engine's log-probs against the trainer's (`engine_mismatch`) and stale old
log-probs (`stale_old_logprobs`). Each is a pure function of the evidence.

With the model evidence they read `signal_reading` (which stored signal is the odd one out, on which ranks, with
which witness) and the loss channel (which term carries the gradient); a family reaches 1.0 only with a witness that
separates it from the others. Without the model only the old-vs-rollout log-ratios of the batch are known: they
cannot say which of the two is wrong, so `engine_mismatch` and `stale_old_logprobs` then name each other as tied.
"""

from __future__ import annotations

import math

from axrl_spike_replay.diagnosis.evidence.signal_reading import (
    outside_fraction,
)
from axrl_spike_replay.diagnosis.rules.causes import (
    LN2,
    Cause,
    Evidence,
    Experiment,
    is_finite,
    percent_text,
    top_carriers,
    unit_strength,
)
from axrl_spike_replay.diagnosis.rules.signal_families.signal_parts import (
    REFUTE_STAYS,
    base_signal,
    carried_lines,
    channel_lines,
    drop_ranks,
    loss_uses,
    not_in_loss,
    off_static,
    ranks_text,
    static_figures,
)


def _mismatch_experiments(ev: Evidence, outside_vs_rollout: float | None, label: str) -> list[Experiment]:
    out = [
        Experiment(
            "mismatch_token_clip_max=2",
            "truncated importance sampling: the ratio against the trainer's old log-probs, each token weighted by "
            "min(π_old/π_rollout, 2)",
            refutes=REFUTE_STAYS,
        )
    ]
    if base_signal(ev) != "old":
        out.append(
            Experiment(
                "is_base_logprobs=old",
                "takes the PPO ratio against the trainer's own log-probs instead of the rollout's",
                refutes=REFUTE_STAYS,
            )
        )
    if outside_vs_rollout is not None and outside_vs_rollout > 0:
        out.append(
            Experiment(
                "ratio_outlier_mask=token",
                f"masks the tokens whose π/π_rollout leaves [0.5, 2]: {percent_text(outside_vs_rollout)} of loss "
                "tokens "
                f"({label})",
                refutes=REFUTE_STAYS,
            )
        )
    return out


def engine_mismatch(ev: Evidence) -> Cause | None:
    """The rollout engine's log-probs disagree with the trainer, spread over the ranks."""
    if ev.reading is not None:
        return _engine_from_reading(ev)
    figures = static_figures(ev)
    if figures is None:
        return None
    top, outside = figures
    per_rank = off_static(ev)
    strength = 0.5 * min(1.0, outside / 0.05) + 0.3 * min(1.0, top / math.log(10.0))
    carried = _carried_by_ratio(ev)
    strength += 0.2 * carried
    if strength < 0.05:
        return None
    spread = len(per_rank) > 1 and min(per_rank.values()) >= 0.5 * max(per_rank.values())
    evidence = [
        f"max |log(π_old/π_rollout)| on loss tokens {top:.3g} (ratio up to {math.exp(min(top, 700)):.3g}x)",
        f"{percent_text(outside)} of loss tokens have π_old/π_rollout outside [0.5, 2]",
        "per rank, samples with a token outside [0.5, 2]: "
        + ", ".join(f"rank {r} {percent_text(v)}" for r, v in sorted(per_rank.items())),
        "without the replay the old and rollout log-probs cannot be told apart: `diagnose --model always` (or "
        "`recompute=old_logprobs`) says which one is off",
    ]
    strength = unit_strength(strength) * (1.0 if spread else 0.6)
    cause = Cause(
        "engine_mismatch",
        "rollout/trainer log-prob mismatch",
        min(strength, 0.8),
        evidence,
        {"max_abs_log_ratio_old_vs_rollout": top, "fraction_outside_0.5_2_old_vs_rollout": outside},
        # no ratio_outlier_mask: it measures π/π_rollout, unknown without the replay (old vs rollout is not it when
        # the old log-probs are the broken ones, and the mask then masks nothing)
        _mismatch_experiments(ev, None, ""),
        tied_with=["stale_old_logprobs"],
    )
    if not loss_uses(ev, "rollout"):
        not_in_loss(cause, "the rollout log-probs", "the run's ratio is taken against the old log-probs")
    return cause


def _carried_by_ratio(ev: Evidence) -> float:
    """The fraction of the top carriers whose tokens' old/rollout log-ratio leaves [ln 0.5, ln 2]."""
    carriers = top_carriers(ev.attribution)
    if not carriers:
        return 0.0
    rows = {(r["rank"], r["sample"]): r for r in ev.analysis.samples["rows"]}
    hit = 0
    for s in carriers:
        row = rows.get((s.rank, s.sample))
        lr = row["max_abs_log_ratio_old_vs_rollout"] if row else None
        hit += bool(is_finite(lr) and lr > LN2)
    return hit / len(carriers)


def _engine_from_reading(ev: Evidence) -> Cause | None:
    assert ev.reading is not None
    odd = ev.reading.odd_signal("rollout")
    if odd is None:
        return None
    ranks = odd.ranks
    spread = odd.spread or len(ranks) == len(ev.reading.levels.get("rollout", {}))
    strength = (0.6 if spread else 0.4) + (0.4 if odd.separated else 0.0)
    outside = outside_fraction(ev.reading, "rollout")
    term, channel = channel_lines(ev, [] if spread else ranks)
    cause = Cause(
        "engine_mismatch",
        "rollout/trainer log-prob mismatch" + ("" if spread else f" on rank {ranks_text(ranks)}"),
        unit_strength(strength),
        carried_lines(ev, "rollout") + odd.evidence + odd.witnesses + channel,
        {
            "levels": odd.levels,
            "fraction_outside_0.5_2_current_vs_rollout": outside,
            "max_abs_log_ratio_current_vs_rollout": max(
                (lv.current_pair.max_abs for lv in ev.reading.levels["rollout"].values() if lv.current_pair),
                default=0.0,
            ),
        },
        _mismatch_experiments(ev, outside, "current vs rollout at the snapshot's weights, as the mask measures it"),
        ranks=[] if spread else ranks,
        samples=odd.samples[:8],
        term=term,
    )
    if not loss_uses(ev, "rollout"):
        not_in_loss(cause, "the rollout log-probs", "the run's ratio is taken against the old log-probs")
    return cause


def stale_old_logprobs(ev: Evidence) -> Cause | None:
    """The stored old log-probs disagree with the policy at the snapshot's weights on some ranks."""
    if ev.reading is None:
        return _stale_static(ev)
    odd = ev.reading.odd_signal("old")
    if odd is None:
        return None
    all_ranks = len(odd.ranks) == len(ev.reading.levels.get("old", {}))
    strength = 1.0 if odd.separated and not all_ranks else (0.8 if odd.separated else 0.45)
    term, channel = channel_lines(ev, odd.ranks)
    item = "old_logprobs" if all_ranks else ",".join(f"old_logprobs:rank{r}" for r in odd.ranks)
    experiments = [
        Experiment(
            f"recompute={item}",
            "takes the old log-probs from the snapshot's weights on those ranks: if the spike goes, the stored ones "
            "were stale or misaligned",
            True,
            refutes=REFUTE_STAYS,
        )
    ]
    if not all_ranks:
        experiments.append(drop_ranks(odd.ranks, "the cause"))
    rollout = ev.reading.levels.get("rollout", {})
    if base_signal(ev) == "old" and rollout and all(r in rollout and rollout[r].level < 1.0 for r in odd.ranks):
        experiments.append(
            Experiment(
                "is_base_logprobs=rollout",
                "takes the ratio against the rollout log-probs, which agree with the replay on those ranks",
                refutes=REFUTE_STAYS,
            )
        )
    cause = Cause(
        "stale_old_logprobs",
        f"stale or misaligned old log-probs on rank {ranks_text(odd.ranks)}",
        strength,
        carried_lines(ev, "old", odd.ranks) + odd.evidence + odd.witnesses + channel,
        {"levels": odd.levels, "zero_filled": odd.zero_filled},
        experiments,
        ranks=odd.ranks,
        samples=odd.samples[:8],
        term=term,
    )
    if not loss_uses(ev, "old"):
        not_in_loss(cause, "the old log-probs", "the run's ratio is taken against the rollout log-probs")
    return cause


def _stale_static(ev: Evidence) -> Cause | None:
    """Without the model: old vs rollout off on some ranks and not on others; tied with engine_mismatch."""
    per_rank = off_static(ev)
    if len(per_rank) < 2:
        return None
    off = sorted(r for r, v in per_rank.items() if v >= 0.25)
    calm = [r for r, v in per_rank.items() if v * 3 <= min((per_rank[o] for o in off), default=0.0)]
    if not off:
        return None
    if not calm:  # off on every rank: a mismatch spread over the ranks is likelier, stale old log-probs still fit
        figures = static_figures(ev)
        return Cause(
            "stale_old_logprobs",
            "stale old log-probs on every rank (or a rollout engine mismatch)",
            0.6,
            [
                f"{percent_text(figures[1] if figures else 0.0)} of loss tokens have π_old/π_rollout outside "
                "[0.5, 2] on "
                "every rank: without the replay it is not known whether the old or the rollout log-probs are off",
            ],
            {"per_rank_fraction_off": per_rank},
            [
                Experiment(
                    "recompute=old_logprobs",
                    "takes the old log-probs from the snapshot's weights: if the spike goes, they were stale",
                    True,
                    refutes=REFUTE_STAYS,
                )
            ],
            tied_with=["engine_mismatch"],
        )
    return Cause(
        "stale_old_logprobs",
        f"old or rollout log-probs off on rank {ranks_text(off)} only",
        0.5,
        [
            "per rank, samples with a token whose π_old/π_rollout leaves [0.5, 2]: "
            + ", ".join(f"rank {r} {percent_text(v)}" for r, v in sorted(per_rank.items())),
            "without the replay it is not known which of the two is off on those ranks",
        ],
        {"per_rank_fraction_off": per_rank},
        [
            Experiment(
                "recompute=" + ",".join(f"old_logprobs:rank{r}" for r in off),
                "takes the old log-probs from the snapshot's weights on those ranks",
                True,
                refutes=REFUTE_STAYS,
            ),
            drop_ranks(off, "the cause"),
        ],
        ranks=off,
        tied_with=["engine_mismatch"],
    )
