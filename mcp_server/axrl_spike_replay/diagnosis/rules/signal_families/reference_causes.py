"""A wrong reference (`bad_ref_logprobs`): the stored reference log-probs singled out on some ranks by their values or
by the KL term's pull, told apart from the policy's drift from the reference, alike on every rank."""

from __future__ import annotations

import math
import statistics

from axrl_spike_replay.diagnosis.evidence.signal_reading import (
    DATA_NATS,
    WITNESS_RATIO,
    OddSignal,
    SignalLevels,
)
from axrl_spike_replay.diagnosis.rules.causes import (
    LIKELY,
    LOSS_READS_LITTLE,
    Cause,
    Evidence,
    is_finite,
)
from axrl_spike_replay.diagnosis.rules.causes_by_rank import NOT_TOLD
from axrl_spike_replay.diagnosis.rules.signal_families.signal_parts import (
    carried_lines,
    channel_lines,
    drop_ranks,
    kl_levers,
    loss_uses,
    not_in_loss,
    ranks_text,
)
from axrl_spike_replay.experiment.step_evidence import TermFigures

KL_READS = 0.05  # share of the gradient below which the loss barely reads a signal's term on its ranks


DRIFT = 0.2  # a reference off alike on every rank: the policy's drift, weak


KL_CARRIES = 0.5  # share of the gradient one rank's KL term carries that singles its reference out (see _kl_witness)


KL_WITNESSED = 0.9  # a reference singled out by its KL term alone (the stored values alone do not separate it)


KL_UNTOLD = 0.5  # the KL term carries the spike on one rank, but that rank's reference does not lean as its pull does


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
    term, channel = channel_lines(ev, odd.ranks)
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
        term, kept = channel_lines(ev, [rank])
        channel = [*lines, *kept]
        if not told:  # the KL term carries the spike there, but no rank's reference is shown wrong
            ranks, strength, all_ranks, untold = [], KL_UNTOLD, True, True
    experiments = kl_levers(ev)
    if ranks and not all_ranks:
        experiments.insert(0, drop_ranks(ranks, "the cause"))
    cause = Cause(
        "bad_ref_logprobs",
        f"wrong or misaligned reference log-probs on rank {ranks_text(ranks or odd.ranks)}",
        strength,
        carried_lines(ev, "ref", ranks or odd.ranks) + odd.evidence + odd.witnesses + channel,
        {"levels": odd.levels, "kl_share": kl.share if kl is not None else None, "kl_share_on_ranks": read},
        experiments,
        ranks=ranks,
        samples=odd.samples[:8],
        term="kl" if term == "kl" or kl is not None else term,
    )
    if untold:
        cause.figures[NOT_TOLD] = True
    if not loss_uses(ev, "ref"):
        not_in_loss(cause, "the reference log-probs", "kl_coef is 0")
    elif read is not None and abs(read) < KL_READS:
        cause.strength = min(cause.strength, LIKELY - 0.05)
        cause.figures[LOSS_READS_LITTLE] = True
        cause.evidence.append(
            f"the KL term on rank {ranks_text(ranks or odd.ranks)} carries {read:.3g} of the gradient: the loss barely "
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
