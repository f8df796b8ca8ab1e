"""The cause families that name a stored signal or a rank: engine/trainer mismatch, stale old log-probs, a wrong
reference, a corrupt routing payload, misaligned masks, one rank's data. Each is a pure function of the evidence.

With the model evidence they read `signal_reading` (which stored signal is the odd one out, on which ranks, with
which witness) and the loss channel (which term carries the gradient); a family reaches 1.0 only with a witness that
separates it from the others. Without the model only the old-vs-rollout log-ratios of the batch are known: they
cannot say which of the two is wrong, so `engine_mismatch` and `stale_old_logprobs` then name each other as tied.

A family whose signal does not enter the run's loss (old log-probs under a rollout-based ratio without truncated IS,
a reference with `kl_coef` 0, recorded routes without routing replay) is capped at LIKELY: it is out of line, but
cannot be what the gradient carries.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from axrl_spike_replay.diagnosis.evidence.signal_reading import (
    DATA_NATS,
    WITNESS_RATIO,
    OddSignal,
    SignalLevels,
    outside_fraction,
)
from axrl_spike_replay.diagnosis.rules import causes
from axrl_spike_replay.diagnosis.rules.advantage_consistency import (
    advantages_against_rewards,
    corroborated,
    inconsistent_ranks,
)
from axrl_spike_replay.diagnosis.rules.causes import (
    LIKELY,
    LN2,
    LOSS_READS_LITTLE,
    Cause,
    Evidence,
    Experiment,
    is_finite,
    percent_text,
    sample_pairs,
    top_carriers,
    unit_strength,
)
from axrl_spike_replay.diagnosis.rules.causes_by_rank import NOT_TOLD
from axrl_spike_replay.diagnosis.rules.rank_inputs import (
    advantages_past_rewards,
    mask_over_prompt,
    mask_over_unrecorded,
    mask_ranks,
    overscaled_ranks,
    rank_advantage_scale,
    scaled_ranks,
)
from axrl_spike_replay.diagnosis.rules.record_norms import judged_local_norms, record_only, replaced_note
from axrl_spike_replay.diagnosis.rules.token_alignment import token_misalignment
from axrl_spike_replay.experiment.step_evidence import TermFigures

REFUTE_STAYS = "the spike stays within 20 % of the baseline"
KL_READS = 0.05  # share of the gradient below which the loss barely reads a signal's term on its ranks
DRIFT = 0.2  # a reference off alike on every rank: the policy's drift, weak
DATA_SCALE = 3.0  # ... or its typical |advantage| this many times the others' (or a third of it)
KL_CARRIES = 0.5  # share of the gradient one rank's KL term carries that singles its reference out (see _kl_witness)
KL_WITNESSED = 0.9  # a reference singled out by its KL term alone (the stored values alone do not separate it)
KL_UNTOLD = 0.5  # the KL term carries the spike on one rank, but that rank's reference does not lean as its pull does
TRUNCATED_BASE = 0.6  # a mask truncated on some ranks, its share of the gradient unknown or under half
TRUNCATED_CARRIES = 0.9  # ... those ranks carrying at least half of the gradient


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _base(ev: Evidence) -> str:
    return ev.loss.is_base_logprobs if ev.loss is not None else "old"


def _uses(ev: Evidence, signal: str) -> bool:
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


def _replays_routes(ev: Evidence) -> bool:
    return ev.routing is None or ev.routing.replay != "off"


def _channel_lines(ev: Evidence, ranks: Sequence[int]) -> tuple[str | None, list[str]]:
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


def _rank_share(ev: Evidence, ranks: Sequence[int]) -> float | None:
    """The share of the gradient the named ranks' terms carry (channel), None without it."""
    if ev.channel is None:
        return None
    return math.fsum(x.share for t in ev.channel.terms for x in t.ranks if x.rank in ranks)


def _off_static(ev: Evidence) -> dict[int, float]:
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


def _static_figures(ev: Evidence) -> tuple[float, float] | None:
    """(max |log(π_old/π_rollout)|, share of loss tokens outside [0.5, 2]) from the batch, None without them."""
    from axrl_spike_replay.diagnosis.rules.causes import finite_fraction_outside

    a = ev.analysis
    if not a.ratio_old_vs_rollout.get("available"):
        return None
    outside = finite_fraction_outside(a.ratio_old_vs_rollout)
    if outside is None:
        return None
    return a.ratio_old_vs_rollout["abs_log_ratio"].get("max") or 0.0, outside


def _mismatch_experiments(ev: Evidence, outside_vs_rollout: float | None, label: str) -> list[Experiment]:
    out = [
        Experiment(
            "mismatch_token_clip_max=2",
            "truncated importance sampling: the ratio against the trainer's old log-probs, each token weighted by "
            "min(π_old/π_rollout, 2)",
            refutes=REFUTE_STAYS,
        )
    ]
    if _base(ev) != "old":
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
    figures = _static_figures(ev)
    if figures is None:
        return None
    top, outside = figures
    per_rank = _off_static(ev)
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
    if not _uses(ev, "rollout"):
        _not_in_loss(cause, "the rollout log-probs", "the run's ratio is taken against the old log-probs")
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
    term, channel = _channel_lines(ev, [] if spread else ranks)
    cause = Cause(
        "engine_mismatch",
        "rollout/trainer log-prob mismatch" + ("" if spread else f" on rank {_ranks(ranks)}"),
        unit_strength(strength),
        _carried(ev, "rollout") + odd.evidence + odd.witnesses + channel,
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
    if not _uses(ev, "rollout"):
        _not_in_loss(cause, "the rollout log-probs", "the run's ratio is taken against the old log-probs")
    return cause


def _carried(ev: Evidence, signal: str, ranks: Sequence[int] = ()) -> list[str]:
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


def _not_in_loss(cause: Cause, what: str, why: str) -> None:
    cause.strength = min(cause.strength, LIKELY - 0.05)
    cause.figures[LOSS_READS_LITTLE] = True
    cause.evidence.append(
        f"{what} do not enter this run's loss ({why}): out of line, but not what the gradient carries"
    )


def _drop_ranks(ranks: Sequence[int], what: str) -> Experiment:
    return Experiment(
        f"drop_ranks={_ranks(ranks)}",
        f"leaves rank {_ranks(ranks)}'s samples out: if the spike goes, {what} is on that rank",
        True,
        refutes=REFUTE_STAYS,
    )


def stale_old_logprobs(ev: Evidence) -> Cause | None:
    """The stored old log-probs disagree with the policy at the snapshot's weights on some ranks."""
    if ev.reading is None:
        return _stale_static(ev)
    odd = ev.reading.odd_signal("old")
    if odd is None:
        return None
    all_ranks = len(odd.ranks) == len(ev.reading.levels.get("old", {}))
    strength = 1.0 if odd.separated and not all_ranks else (0.8 if odd.separated else 0.45)
    term, channel = _channel_lines(ev, odd.ranks)
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
        experiments.append(_drop_ranks(odd.ranks, "the cause"))
    rollout = ev.reading.levels.get("rollout", {})
    if _base(ev) == "old" and rollout and all(r in rollout and rollout[r].level < 1.0 for r in odd.ranks):
        experiments.append(
            Experiment(
                "is_base_logprobs=rollout",
                "takes the ratio against the rollout log-probs, which agree with the replay on those ranks",
                refutes=REFUTE_STAYS,
            )
        )
    cause = Cause(
        "stale_old_logprobs",
        f"stale or misaligned old log-probs on rank {_ranks(odd.ranks)}",
        strength,
        _carried(ev, "old", odd.ranks) + odd.evidence + odd.witnesses + channel,
        {"levels": odd.levels, "zero_filled": odd.zero_filled},
        experiments,
        ranks=odd.ranks,
        samples=odd.samples[:8],
        term=term,
    )
    if not _uses(ev, "old"):
        _not_in_loss(cause, "the old log-probs", "the run's ratio is taken against the rollout log-probs")
    return cause


def _stale_static(ev: Evidence) -> Cause | None:
    """Without the model: old vs rollout off on some ranks and not on others; tied with engine_mismatch."""
    per_rank = _off_static(ev)
    if len(per_rank) < 2:
        return None
    off = sorted(r for r, v in per_rank.items() if v >= 0.25)
    calm = [r for r, v in per_rank.items() if v * 3 <= min((per_rank[o] for o in off), default=0.0)]
    if not off:
        return None
    if not calm:  # off on every rank: a mismatch spread over the ranks is likelier, stale old log-probs still fit
        figures = _static_figures(ev)
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
        f"old or rollout log-probs off on rank {_ranks(off)} only",
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
            _drop_ranks(off, "the cause"),
        ],
        ranks=off,
        tied_with=["engine_mismatch"],
    )


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


def bad_ref_logprobs(ev: Evidence) -> Cause | None:
    """The stored reference log-probs are off on some ranks (the KL term then carries the spike).

    The reference is another model: the policy's distance to it alike on every rank is drift, not a broken part
    (weak, DRIFT). A reference singled out on some ranks is the cause only as far as the loss reads it there: when
    those ranks' KL term carries under KL_READS of the gradient, it is out of line but not what the gradient
    carries (capped below LIKELY). Where the stored values single no rank out (off alike, or nowhere clearly off),
    what the reference does to the step can (`_kl_witness`)."""
    if ev.reading is None:
        return None
    odd = ev.reading.odd_signal("ref")
    witnessed = [] if odd is not None and odd.separated else _kl_witness(ev)
    if odd is None:
        if not witnessed:
            return None
        odd = OddSignal("ref", [], {}, False)  # no rank's stored reference clearly off by level
    all_ranks = len(odd.ranks) == len(ev.reading.levels.get("ref", {}))
    term, channel = _channel_lines(ev, odd.ranks)
    kl = ev.channel.term("kl") if ev.channel is not None else None
    read = math.fsum(x.share for x in kl.ranks if x.rank in odd.ranks) if kl is not None else None
    strength = 1.0 if odd.separated else DRIFT
    if not odd.separated and odd.ranks:
        channel.append(
            "the policy's distance to the reference is alike on every rank: drift the KL term bounds, or a reference "
            "wrong everywhere; nothing here tells them apart (`kl_coef=0` says whether the KL term carries the spike)"
        )
    ranks = odd.ranks if odd.separated else []
    untold = False
    if witnessed:
        rank, lines, told = witnessed[0]
        ranks, strength, all_ranks = [rank], KL_WITNESSED, False
        read = next((x.share for x in kl.ranks if x.rank == rank), None) if kl is not None else None
        term, kept = _channel_lines(ev, [rank])
        channel = [*lines, *kept]
        if not told:  # the KL term carries the spike there, but no rank's reference is shown wrong
            ranks, strength, all_ranks, untold = [], KL_UNTOLD, True, True
    experiments = kl_levers(ev)
    if ranks and not all_ranks:
        experiments.insert(0, _drop_ranks(ranks, "the cause"))
    cause = Cause(
        "bad_ref_logprobs",
        f"wrong or misaligned reference log-probs on rank {_ranks(ranks or odd.ranks)}",
        strength,
        _carried(ev, "ref", ranks or odd.ranks) + odd.evidence + odd.witnesses + channel,
        {"levels": odd.levels, "kl_share": kl.share if kl is not None else None, "kl_share_on_ranks": read},
        experiments,
        ranks=ranks,
        samples=odd.samples[:8],
        term="kl" if term == "kl" or kl is not None else term,
    )
    if untold:
        cause.figures[NOT_TOLD] = True
    if not _uses(ev, "ref"):
        _not_in_loss(cause, "the reference log-probs", "kl_coef is 0")
    elif read is not None and abs(read) < KL_READS:
        cause.strength = min(cause.strength, LIKELY - 0.05)
        cause.figures[LOSS_READS_LITTLE] = True
        cause.evidence.append(
            f"the KL term on rank {_ranks(ranks or odd.ranks)} carries {read:.3g} of the gradient: the loss barely "
            "reads the reference there; out of line, but not what the gradient carries"
        )
    return cause


def _kl_witness(ev: Evidence) -> list[tuple[int, list[str], bool]]:
    """A reference that no rank's stored values single out (off alike on every rank, or nowhere clearly off), but
    whose KL term on one rank carries KL_CARRIES of the gradient and WITNESS_RATIO times what it carries on any
    other rank, and pulls WITNESS_RATIO times harder there than on any other (`_kl_pull_stands_out`), while that
    rank's data is as likely to the policy and no other stored signal or mask of it is out of line: the policy's
    drift from the reference is alike on every rank, so what its KL term pulls should be too; there the reference
    itself differs ([(rank, sentences)] or []). Not on a rank whose tokens are DATA_NATS per token less likely than
    the policy's own samples would be (its surprise past its entropy): there k3's exp(ref - log π) is carried by a
    few hard tokens, and a rank's share is chance.

    The witness is what the reference does to the step, not how far its stored values are from the replay: a
    distance is symmetric, while the KL term pulls hardest where the reference holds a token far likelier than the
    policy does, so a wrong reference can sit closer to the policy than the others' by level and pull far harder.
    The share alone is not enough either: a share is a projection on the whole gradient, and it grows on a rank
    whose other terms carry nothing (every advantage there 0: its policy term is 0 whatever its data) or whose KL
    pull happens to lie along a small replayed gradient, while its reference pulls as every other rank's.

    The pull names the rank's reference (told: True) only where that reference, over the rank's loss tokens, sits at
    least as far above the policy as the other ranks' typically do (`_lean_against_pull`): k3 pulls where the
    reference sits above the policy, and a reference that differs there leans that way as a whole. A pull carried by
    one token the policy finds unlikely, on a rank whose reference sits further below the policy than the others',
    is that token's, which any right reference pulls on too: the rank is returned with told False (cannot tell)."""
    assert ev.reading is not None
    kl = ev.channel.term("kl") if ev.channel is not None else None
    levels = ev.reading.levels.get("ref", {})
    if kl is None or len(kl.ranks) < 2:
        return []
    shares = {x.rank: x.share for x in kl.ranks}
    for r, share in shares.items():
        others = [abs(v) for o, v in shares.items() if o != r]
        if share < KL_CARRIES or share < WITNESS_RATIO * max(others) or r not in levels:
            continue
        pull = _kl_pull_stands_out(kl, r)
        if pull is None:
            continue  # its share, not its pull, singles it out: the other terms' and ranks' gradients explain it
        if r in ev.reading.mask_ranks or r in ev.reading.truncated:
            continue
        if any(r in o.ranks and o.separated for o in ev.reading.odd if o.signal != "ref"):
            continue  # that rank's forward or another signal is off: the KL term carries that
        typical = ev.reading.likelihood
        rest = [v for o, v in typical.items() if o != r]
        if r in typical and rest and statistics.median(rest) - typical[r] >= DATA_NATS:
            continue  # its data is far less likely: hard data pulls the KL term too
        if ev.reading.surprise.get(r, 0.0) >= DATA_NATS:
            continue  # its tokens are not the policy's own samples: a few of them fill k3's tail, whatever the ref
        other_levels = [lv.level for o, lv in levels.items() if o != r]
        against = _lean_against_pull(levels, r)
        if against is not None:
            return [
                (
                    r,
                    [
                        f"the KL term on rank {r} carries {share:.3g} of the gradient against at most "
                        f"{max(others):.3g} on the other ranks, and {pull}",
                        against,
                    ],
                    False,
                )
            ]
        return [
            (
                r,
                [
                    f"the KL term on rank {r} carries {share:.3g} of the gradient against at most {max(others):.3g} on "
                    f"the other ranks, and {pull}, while its data is as likely to the policy as the others' and as "
                    f"its own samples would be, and its other signals agree: the reference differs on rank {r}, "
                    "beyond the drift alike on every rank",
                    f"rank {r}'s stored reference is {levels[r].level:.3g} from the replay by level against "
                    f"{min(other_levels):.3g} to {max(other_levels):.3g} on the other ranks: a distance says nothing "
                    "of its direction, and the KL term pulls hardest where the reference holds a token far likelier "
                    "than the policy does; what the reference does to the step singles it out, not how far it is",
                ],
                True,
            )
        ]
    return []


def _lean_against_pull(levels: dict[int, SignalLevels], rank: int) -> str | None:
    """A sentence when `rank`'s stored reference, over its loss tokens, sits further below the policy than the other
    ranks' typically do (its signed mean of log π - log π_ref above their median), so a KL pull there is a few
    tokens' and not the reference's; None when it leans as the pull does, or the signed means were not recorded."""
    mine = _signed(levels.get(rank))
    others = [v for o, lv in levels.items() if o != rank and (v := _signed(lv)) is not None]
    if mine is None or not others or mine <= statistics.median(others):
        return None
    return (
        f"yet rank {rank}'s stored reference sits {mine:.3g} nats below the policy on average over its loss tokens "
        f"against a median {statistics.median(others):.3g} on the other ranks ({min(others):.3g} to "
        f"{max(others):.3g}): it leans no further above the policy than theirs, the way k3 pulls; the pull is a few "
        "tokens the policy finds unlikely there, which any reference pulls on, and which rank's reference is wrong, "
        "if any, is not told"
    )


def _signed(levels: SignalLevels | None) -> float | None:
    """The signed mean of log π - log π_ref over a rank's loss tokens, against the run's routing where recorded."""
    if levels is None:
        return None
    pair = levels.current_pair or levels.pair
    return pair.mean if pair is not None and is_finite(pair.mean) else None


def _kl_pull_stands_out(kl: TermFigures, rank: int) -> str | None:
    """How the KL term's own figures on `rank` stand out against the same term on every other rank (a phrase), or
    None when they do not: its gradient norm (what the reference there pulls) WITNESS_RATIO times the largest other
    rank's, and its value (the rank's KL estimate: its reference against the policy's own log-probs), where
    recorded, too. Figures of the term alone, so neither the rank's other terms (a policy term that is 0 when its
    advantages are) nor the other ranks' gradients can make them stand out."""
    mine = next((x for x in kl.ranks if x.rank == rank), None)
    others = [x for x in kl.ranks if x.rank != rank]
    norms = [abs(x.grad_norm) for x in others if is_finite(x.grad_norm)]
    if mine is None or not norms or not is_finite(mine.grad_norm):
        return None
    largest = max(norms)
    if mine.grad_norm < WITNESS_RATIO * largest:
        return None
    pull = f"its gradient norm {mine.grad_norm:.4g} against at most {largest:.4g}"
    if largest > 0:
        pull = f"pulls {mine.grad_norm / largest:.3g}x harder there than on any other rank ({pull}"
    else:
        pull = f"pulls there alone ({pull}"
    values = [abs(x.value) for x in others if is_finite(x.value)]
    if is_finite(mine.value) and values:
        if abs(mine.value) < WITNESS_RATIO * max(values):
            return None
        pull += f"; its value {mine.value:.4g} against at most {max(values):.4g}"
    return pull + ")"


def routing_payload(ev: Evidence) -> Cause | None:
    """The recorded routes of some ranks (or of one layer everywhere) disagree with the model's own routing."""
    if ev.reading is None:
        return _routes_from_layers(ev)
    odd = ev.reading.odd_signal("routes")
    if odd is None:
        return None
    all_ranks = odd.spread or len(odd.ranks) == len(ev.reading.routes)
    strength = 1.0 if odd.separated and not all_ranks else (0.7 if odd.separated else 0.5)
    term, channel = _channel_lines(ev, odd.ranks)
    return _routing_cause(ev, odd, strength, odd.evidence + odd.witnesses + channel, term, all_ranks)


def _routing_cause(
    ev: Evidence, odd: OddSignal, strength: float, evidence: list[str], term: str | None, all_ranks: bool
) -> Cause:
    experiments = []
    if _replays_routes(ev):
        if all_ranks:
            item = "routes,old_logprobs"
        else:
            item = ",".join(f"routes:rank{r},old_logprobs:rank{r}" for r in odd.ranks)
        experiments.append(
            Experiment(
                f"recompute={item}",
                "those ranks route as the model does, with old log-probs taken under those routes: if the spike "
                "goes, the recorded routes were the broken part (routing_replay=off alone is no test: signals stored "
                "under the recorded routes then disagree with the forward, and the spike grows whatever the payload)",
                True,
                refutes=REFUTE_STAYS,
            )
        )
        if odd.layers:
            experiments.append(
                Experiment(
                    f"current_routing_layers={','.join(str(x) for x in odd.layers)}",
                    f"routes layer {','.join(str(x) for x in odd.layers)} on current scores on every rank",
                    refutes=REFUTE_STAYS,
                )
            )
    if not all_ranks:
        experiments.append(_drop_ranks(odd.ranks, "the cause"))
    if term == "kl":  # routes that moved the policy far from a reference taken under other routes
        experiments += kl_levers(ev)
    cause = Cause(
        "routing_payload",
        "corrupt or misaligned routing payload" + ("" if all_ranks else f" on rank {_ranks(odd.ranks)}"),
        unit_strength(strength),
        evidence,
        {"levels": odd.levels, "layers": odd.layers},
        experiments,
        ranks=[] if all_ranks else odd.ranks,
        term=term,
    )
    if not _replays_routes(ev):
        cause.strength = min(cause.strength, LIKELY - 0.05)
        cause.figures[LOSS_READS_LITTLE] = True
        cause.evidence.append("the run does not replay recorded routes: they do not enter its forward")
    return cause


def _routes_from_layers(ev: Evidence) -> Cause | None:
    """Merged route agreement only (an attribution passed in, no signal check): one layer far off."""
    if ev.routes is None or not ev.routes.layers:
        return None
    layers = [x for x in ev.routes.layers if is_finite(x.loss_disagreement)]
    if not layers:
        return None
    worst = max(layers, key=lambda x: x.loss_disagreement or 0.0)
    d = worst.loss_disagreement or 0.0
    rest = [x.loss_disagreement or 0.0 for x in layers if x is not worst]
    typical = statistics.median(rest) if rest else 0.0
    if d < 0.1 or (rest and d < 3 * typical):
        return None
    odd = OddSignal("routes", [], {}, True, layers=[worst.layer])
    evidence = [
        f"the model's own routing differs from the recorded routes in layer {worst.layer} on {percent_text(d)} of loss "
        f"tokens (median of the other layers {percent_text(typical)}), merged over the ranks",
    ]
    return _routing_cause(ev, odd, unit_strength(d / 0.3) * 0.8, evidence, None, True)


def _strongest(*found: Cause | None) -> Cause | None:
    return max((c for c in found if c is not None), key=lambda c: c.strength, default=None)


def mask_misalignment(ev: Evidence) -> Cause | None:
    """The strongest of the stored signals' reading of the masks (`_signal_masks`) and the per-rank comparisons of
    where the masks start (`rank_inputs.mask_over_prompt`) and of what they cover against the engine's record
    (`rank_inputs.mask_over_unrecorded`), and a rank's tokens one offset off its stored per-token fields
    (`token_alignment.token_misalignment`)."""
    return _strongest(_signal_masks(ev), mask_over_prompt(ev), mask_over_unrecorded(ev), token_misalignment(ev))


def outlier_advantage(ev: Evidence) -> Cause | None:
    """The strongest of a few samples' outlier advantages (`causes.outlier_advantage`), one rank's advantages on
    another scale (`rank_inputs.rank_advantage_scale`), wider than its rewards explain
    (`rank_inputs.advantages_past_rewards`) or not what the recorded estimator makes of its own rewards
    (`advantage_consistency.advantages_against_rewards`)."""
    found = _strongest(causes.outlier_advantage(ev), rank_advantage_scale(ev), advantages_past_rewards(ev))
    return corroborated(found, advantages_against_rewards(ev))


def _signal_masks(ev: Evidence) -> Cause | None:
    """Loss masks over tokens no stored signal covers (every stored log-prob a 0 fill there), or masks that stop
    short of what was generated on some ranks where the others' run to the end (truncated).

    A misaligned mask is read off the stored values themselves (0.95 on some ranks). A truncated one only says the
    loss leaves tokens out there; it is the cause as far as those ranks carry the gradient (TRUNCATED_BASE;
    TRUNCATED_CARRIES when they carry at least half of it)."""
    if ev.reading is None or not (ev.reading.mask_ranks or ev.reading.truncated):
        return None
    if not ev.reading.mask_ranks:
        return _truncated_mask(ev)
    ranks = sorted(ev.reading.mask_ranks)
    every = len(ranks) == len({r for by in ev.reading.levels.values() for r in by})
    evidence = [
        f"rank {r}: {percent_text(v)} of loss tokens hold 0 in the stored "
        f"{' and '.join(ev.reading.mask_signals.get(r, ['log-prob']))} log-probs while the policy's log-prob there "
        "is far from 0: the loss mask covers tokens those signals were not stored for (shifted, truncated or "
        "inverted against them)"
        for r, v in ev.reading.mask_ranks.items()
    ]
    experiments = [] if every else [_drop_ranks(ranks, "the misaligned mask")]
    return Cause(
        "mask_misalignment",
        "loss mask misaligned with the stored signals" + ("" if every else f" on rank {_ranks(ranks)}"),
        0.7 if every else 0.95,
        evidence,
        {"zero_filled": ev.reading.mask_ranks},
        experiments,
        ranks=[] if every else ranks,
    )


def _truncated_mask(ev: Evidence) -> Cause:
    assert ev.reading is not None
    ranks = sorted(ev.reading.truncated)
    tails = ev.reading.tails
    evidence = [
        f"rank {r}: on {percent_text(tails[r][0])} of samples the loss mask stops before the last token the "
        "engine generated "
        f"(a stored rollout log-prob), {tails[r][1]:.3g} tokens left out per sample on average"
        for r in ranks
    ]
    whole = [
        f"rank {r} ({percent_text(v[0])} of samples stop short)" for r, v in sorted(tails.items()) if r not in ranks
    ]
    evidence.append("ranks whose masks run to the end: " + ", ".join(whole))
    share = _rank_share(ev, ranks)
    strength = TRUNCATED_BASE
    if share is not None:
        evidence.append(f"rank {_ranks(ranks)}'s loss terms carry {share:.3g} of the gradient")
        if share >= 0.5:
            strength = TRUNCATED_CARRIES
    term, channel = _channel_lines(ev, ranks)
    return Cause(
        "mask_misalignment",
        f"loss mask truncated on rank {_ranks(ranks)}",
        strength,
        evidence + channel,
        {"truncated": {r: {"samples": tails[r][0], "tokens": tails[r][1]} for r in ranks}, "rank_share": share},
        [_drop_ranks(ranks, "the truncated mask")],
        ranks=ranks,
        term=term,
    )


def _median_abs_advantage(ev: Evidence) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for row in ev.analysis.samples["rows"]:
        if row["loss_tokens"] and is_finite(row["advantage"]):
            by.setdefault(row["rank"], []).append(abs(row["advantage"]))
    return {r: statistics.median(v) for r, v in by.items() if v}


def _data_differs(ev: Evidence, rank: int) -> list[str]:
    """How `rank`'s batch differs from the other ranks' in what it was fed, each a sentence ([]: alike, or not
    known): its typical sample (median over samples of the mean log π on loss tokens, at the snapshot's weights)
    DATA_NATS less likely per token, or its typical |advantage| DATA_SCALE times larger or smaller. Unknown (no
    per-rank likelihood): the rank is given the benefit of the doubt, as before the comparison existed."""
    assert ev.reading is not None
    found: list[str] = []
    typical = ev.reading.likelihood
    if rank not in typical or len(typical) < 2:
        return ["(how likely each rank's data is was not compared)"]
    others = statistics.median(v for r, v in typical.items() if r != rank)
    if others - typical[rank] >= DATA_NATS:
        found.append(
            f"rank {rank}'s typical sample has mean log π {typical[rank]:.3g} per loss token against "
            f"{others:.3g} on the other ranks: the policy finds what that rank was fed far less likely"
        )
    adv = _median_abs_advantage(ev)
    if rank in adv and len(adv) >= 2:
        rest = statistics.median(v for r, v in adv.items() if r != rank)
        a = adv[rank]
        if (rest > 0 and a >= DATA_SCALE * rest) or (a > 0 and rest >= DATA_SCALE * a):
            found.append(f"rank {rank}'s typical |advantage| {a:.3g} against {rest:.3g} on the other ranks")
    return found


def one_rank_data(ev: Evidence) -> Cause | None:
    """One rank's batch carries the spike, with none of its stored signals out of line."""
    if ev.world_size < 2:
        return None
    shares: dict[int, float] = {}
    if ev.attribution is not None:
        for s in ev.attribution.samples:
            if is_finite(s.share):
                shares[s.rank] = shares.get(s.rank, 0.0) + s.share
    local, replaced = judged_local_norms(ev)  # the replay's where a rank's record does not reproduce
    finite = {r: v for r, v in local.items() if math.isfinite(v)}
    evidence: list[str] = replaced_note(replaced, local)
    strength, rank = 0.0, None
    if len(finite) >= 2:
        largest = max(finite, key=lambda r: finite[r])
        others = statistics.median(v for r, v in finite.items() if r != largest)
        factor = finite[largest] / others if others > 0 else math.inf
        if factor >= 3:  # only then is it that rank's (a merely largest rank must not veto the shares below)
            rank = largest
            strength = min(0.6, 0.2 * math.log2(factor))
            evidence.append(
                f"rank {rank}'s local grad norm {finite[rank]:.4g} is {factor:.3g}x the other ranks' "
                f"median {others:.4g}"
            )
    if shares:
        top_rank = max(shares, key=lambda r: shares[r])
        if shares[top_rank] >= 0.8 and (rank is None or rank == top_rank):
            rank = top_rank
            strength = max(strength, 0.5)
            evidence.append(f"rank {top_rank}'s top samples carry {percent_text(shares[top_rank])} of ‖g‖")
    if ev.channel is not None:
        by_rank = {r: _rank_share(ev, [r]) or 0.0 for r in range(ev.world_size)}
        top_rank = max(by_rank, key=lambda r: by_rank[r])
        if by_rank[top_rank] >= 0.8 and (rank is None or rank == top_rank):
            rank = top_rank
            strength = max(strength, 0.6)
            evidence.append(f"rank {top_rank}'s loss terms carry {by_rank[top_rank]:.3g} of the gradient")
    if rank is None or len(evidence) == len(replaced_note(replaced, local)):
        return record_only(replaced, local)  # singled out by an unreproduced record alone: said, weak
    if rank in mask_ranks(ev) or rank in scaled_ranks(ev) or rank in overscaled_ranks(ev):  # its mask or advantages
        return None
    if rank in inconsistent_ranks(ev)[2]:  # its advantages are not what the recorded estimator makes of its rewards
        return None
    if ev.reading is not None:
        if rank in ev.reading.mask_ranks:  # its loss mask covers tokens no signal was stored for: the mask explains it
            return None
        if rank in ev.reading.truncated:  # its loss masks stop short where the others' do not: the mask explains it
            return None
        # a stored signal singled out on that rank explains it (one off alike on every rank, as the policy's drift
        # from the reference, singles out no rank): the data is not the broken part
        if any(rank in o.ranks and o.separated for o in ev.reading.odd):
            return None
        differs = _data_differs(ev, rank)
        if not differs:
            return Cause(
                "one_rank_data",
                f"one rank's data (rank {rank})?",
                LIKELY - 0.05,
                [
                    *evidence,
                    f"rank {rank}'s data is alike the other ranks' (its typical sample as likely to the policy, its "
                    "advantages of the same scale): a few hard samples that landed on that rank, not what it was fed",
                ],
                {"rank": rank},
                [_drop_ranks([rank], "the spike")],
                ranks=[rank],
            )
        evidence += differs
        strength = min(1.0, strength + 0.2)
        drift = [o.signal for o in ev.reading.odd if rank in o.ranks]
        evidence.append(
            f"no stored signal of rank {rank} is singled out against the replay ({', '.join(drift)} off alike on "
            "every rank)"
            if drift
            else f"every stored signal of rank {rank} agrees with the replay"
        )
    samples = [(s.rank, s.sample) for s in top_carriers(ev.attribution, 0.8) if s.rank == rank]
    experiments = [_drop_ranks([rank], "the spike")]
    if samples:
        experiments.append(
            Experiment(
                f"drop_samples={sample_pairs(samples)}",
                f"leaves out rank {rank}'s top samples: whether the spike is those samples",
                True,
                refutes=REFUTE_STAYS,
            )
        )
    term, channel = _channel_lines(ev, [rank])
    if term == "kl":
        experiments += kl_levers(ev)
    return Cause(
        "one_rank_data",
        f"one rank's data (rank {rank})",
        strength,
        evidence + channel,
        {"rank": rank},
        experiments,
        ranks=[rank],
        samples=samples,
        term=term,
    )
