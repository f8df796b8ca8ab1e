"""The families of one rank's batch: misaligned masks (`mask_misalignment`), outlier advantages
(`outlier_advantage`) and one rank's data (`one_rank_data`), each the strongest of its per-rank comparisons."""

from __future__ import annotations

import math
import statistics

from axrl_spike_replay.diagnosis.evidence.signal_reading import (
    DATA_NATS,
)
from axrl_spike_replay.diagnosis.rules import causes
from axrl_spike_replay.diagnosis.rules.advantage_consistency import (
    advantages_against_rewards,
    corroborated,
    inconsistent_ranks,
)
from axrl_spike_replay.diagnosis.rules.causes import (
    LIKELY,
    Cause,
    Evidence,
    Experiment,
    is_finite,
    percent_text,
    sample_pairs,
    top_carriers,
)
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
from axrl_spike_replay.diagnosis.rules.signal_families.signal_parts import (
    REFUTE_STAYS,
    channel_lines,
    drop_ranks,
    kl_levers,
    rank_share,
    ranks_text,
    strongest,
)
from axrl_spike_replay.diagnosis.rules.token_alignment import token_misalignment

TRUNCATED_BASE = 0.6  # a mask truncated on some ranks, its share of the gradient unknown or under half


TRUNCATED_CARRIES = 0.9  # ... those ranks carrying at least half of the gradient


DATA_SCALE = 3.0  # ... or its typical |advantage| this many times the others' (or a third of it)


def mask_misalignment(ev: Evidence) -> Cause | None:
    """The strongest of the stored signals' reading of the masks (`_signal_masks`) and the per-rank comparisons of
    where the masks start (`rank_inputs.mask_over_prompt`) and of what they cover against the engine's record
    (`rank_inputs.mask_over_unrecorded`), and a rank's tokens one offset off its stored per-token fields
    (`token_alignment.token_misalignment`)."""
    return strongest(_signal_masks(ev), mask_over_prompt(ev), mask_over_unrecorded(ev), token_misalignment(ev))


def outlier_advantage(ev: Evidence) -> Cause | None:
    """The strongest of a few samples' outlier advantages (`causes.outlier_advantage`), one rank's advantages on
    another scale (`rank_inputs.rank_advantage_scale`), wider than its rewards explain
    (`rank_inputs.advantages_past_rewards`) or not what the recorded estimator makes of its own rewards
    (`advantage_consistency.advantages_against_rewards`)."""
    found = strongest(causes.outlier_advantage(ev), rank_advantage_scale(ev), advantages_past_rewards(ev))
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
    experiments = [] if every else [drop_ranks(ranks, "the misaligned mask")]
    return Cause(
        "mask_misalignment",
        "loss mask misaligned with the stored signals" + ("" if every else f" on rank {ranks_text(ranks)}"),
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
    share = rank_share(ev, ranks)
    strength = TRUNCATED_BASE
    if share is not None:
        evidence.append(f"rank {ranks_text(ranks)}'s loss terms carry {share:.3g} of the gradient")
        if share >= 0.5:
            strength = TRUNCATED_CARRIES
    term, channel = channel_lines(ev, ranks)
    return Cause(
        "mask_misalignment",
        f"loss mask truncated on rank {ranks_text(ranks)}",
        strength,
        evidence + channel,
        {"truncated": {r: {"samples": tails[r][0], "tokens": tails[r][1]} for r in ranks}, "rank_share": share},
        [drop_ranks(ranks, "the truncated mask")],
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
        by_rank = {r: rank_share(ev, [r]) or 0.0 for r in range(ev.world_size)}
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
                [drop_ranks([rank], "the spike")],
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
    experiments = [drop_ranks([rank], "the spike")]
    if samples:
        experiments.append(
            Experiment(
                f"drop_samples={sample_pairs(samples)}",
                f"leaves out rank {rank}'s top samples: whether the spike is those samples",
                True,
                refutes=REFUTE_STAYS,
            )
        )
    term, channel = channel_lines(ev, [rank])
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
