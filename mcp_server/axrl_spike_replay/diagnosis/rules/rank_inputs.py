"""Per-rank comparisons of what each rank's batch fed the loss, the other ranks as witnesses, read off the snapshot
alone (no model): which input of a rank differs from the others' names the broken part there.

- Where the loss masks start: a rank whose loss starts before every other rank's earliest loss position on most of
  its samples (`LEADING`), where another rank's do not (`WITNESS_RATIO`), trains on tokens the others leave out (the
  prompt, or a response shifted against its mask): a loss mask misaligned there (`mask_misalignment`).
- What the loss covers against what the engine recorded: a rank whose loss covers positions its rollout engine
  routed no token at (every expert slot of the routing payload -1 there, as for padding the engine never ran),
  on `UNRECORDED` of its loss tokens or more, while another rank's loss covers none (`WITNESS_RATIO`), trains on
  tokens the engine did not generate: its loss mask reaches past the response (`mask_misalignment`).
- The scale of the advantages: a rank whose typical |advantage| is `SCALE` times the other ranks' median and above
  every advantage they have fed its loss advantages on another scale: the advantages are the broken part there
  (`outlier_advantage` on that rank), not the data, as long as the policy finds that rank's data as likely as the
  others' (`signal_reading` compares it, with the model).
- The advantages against the rewards they were computed from, group by group (the samples of one prompt): every
  usual estimator gives a group advantages spread at most about as widely as a standardised group (std 1: GRPO) or
  as its rewards (std of the rewards: a baseline, RLOO, GRPO without the std). A rank whose groups' advantages are
  spread `SPREAD` (`SCALE`: another scale) times wider than both, on most of its groups whose advantages differ at
  all, has advantages no estimator makes from its rewards (`outlier_advantage` on that rank): it needs no other
  rank as a witness, so it holds where every other rank's advantages are 0.

Each is as strong as the share of the gradient those ranks carry says (`BASE`; `CARRIES` when they carry at least
half of it, by the loss channel or a local grad norm `SINGLE_NORM` times the others').
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from axrl_spike_replay.diagnosis.evidence.signal_reading import DATA_NATS, WITNESS_RATIO
from axrl_spike_replay.diagnosis.rules.causes import Cause, Evidence, Experiment, is_finite

LEADING = 0.5  # share of a rank's samples whose loss starts before every other rank's that counts
UNRECORDED = 0.05  # share of a rank's loss tokens at positions its engine recorded no route for that counts
SCALE = 10.0  # a rank's typical |advantage| this many times the other ranks' median, and above their largest
SPREAD = SCALE  # a group's advantage std this many times both 1 and its rewards' std: no usual estimator's
SINGLE_NORM = 3.0  # a rank's local grad norm this many times the others' median: it carries the gradient
BASE = 0.6  # the rank's input differs; its share of the gradient unknown or under half
CARRIES = 0.9  # ... and those ranks carry at least half of the gradient
REFUTE = "the spike stays within 20 % of the baseline"


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


def carry(ev: Evidence, ranks: Sequence[int]) -> tuple[bool, list[str]]:
    """(whether `ranks` carry at least half of the gradient, the figures that say so)."""
    if ev.channel is not None:
        share = math.fsum(x.share for t in ev.channel.terms for x in t.ranks if x.rank in ranks)
        if math.isfinite(share):
            return share >= 0.5, [f"rank {_ranks(ranks)}'s loss terms carry {share:.3g} of the gradient"]
    local = {k.rank: k.local_grad_norm for k in ev.grads.ranks} if ev.grads is not None else {}
    finite = {r: v for r, v in local.items() if math.isfinite(v)}
    inside = [finite[r] for r in ranks if r in finite]
    outside = [v for r, v in finite.items() if r not in ranks]
    if not inside or not outside:
        return False, []
    rest = statistics.median(outside)
    factor = min(inside) / rest if rest > 0 else math.inf
    line = f"rank {_ranks(ranks)}'s local grad norm is {factor:.3g}x the other ranks' median {rest:.4g}"
    return factor >= SINGLE_NORM, [line]


def standardised_clip(size: int) -> Experiment:
    """`advantage_clip` at a standardised group's largest |advantage| for groups of `size` (population std)."""
    clip = round(math.sqrt(max(size - 1, 1)), 2)
    return Experiment(
        f"advantage_clip={clip:g}",
        f"clamps every advantage to a standardised group's range (|A| at most {clip:g} in a group of {size})",
        refutes=REFUTE,
    )


def _drop(ranks: Sequence[int], what: str) -> Experiment:
    return Experiment(
        f"drop_ranks={_ranks(ranks)}",
        f"leaves rank {_ranks(ranks)}'s samples out: if the spike goes, {what} is on that rank",
        True,
        refutes=REFUTE,
    )


def _first_positions(ev: Evidence) -> dict[int, list[int]]:
    by: dict[int, list[int]] = {}
    for row in ev.analysis.samples["rows"]:
        first = row.get("first_loss_position")
        if first is not None and row["loss_tokens"]:
            by.setdefault(row["rank"], []).append(int(first))
    return by


def leading_masks(ev: Evidence) -> dict[int, float]:
    """Per rank, the share of its samples whose loss starts before every other rank's earliest loss position."""
    by = _first_positions(ev)
    shares: dict[int, float] = {}
    for rank, firsts in by.items():
        others = [f for r, v in by.items() if r != rank for f in v]
        if others:
            earliest = min(others)
            shares[rank] = sum(f < earliest for f in firsts) / len(firsts)
    return shares


def mask_ranks(ev: Evidence) -> list[int]:
    """The ranks whose loss masks start before every other rank's on most samples (LEADING), while some other rank
    is no such rank (a witness; WITNESS_RATIO)."""
    shares = leading_masks(ev)
    return sorted(
        r
        for r, share in shares.items()
        if share >= LEADING and any(o != r and other * WITNESS_RATIO <= share for o, other in shares.items())
    )


def mask_over_prompt(ev: Evidence) -> Cause | None:
    """Loss masks that start earlier on some ranks than on any other rank, on most of their samples."""
    ranks = mask_ranks(ev)
    if not ranks:
        return None
    shares, by = leading_masks(ev), _first_positions(ev)
    others = [f for r, v in by.items() if r not in ranks for f in v]
    evidence = [
        f"rank {r}: on {100 * shares[r]:.0f} % of samples the loss mask starts before any other rank's (first loss "
        f"position median {statistics.median(by[r]):.3g} against {statistics.median(others):.3g} on the other ranks, "
        f"earliest {min(others)}): it trains on tokens the other ranks leave out (the prompt, or a shifted response)"
        for r in ranks
    ]
    carries, figures = carry(ev, ranks)
    return Cause(
        "mask_misalignment",
        f"loss mask starts early on rank {_ranks(ranks)}",
        CARRIES if carries else BASE,
        evidence + figures,
        {"leading": {r: shares[r] for r in ranks}, "first_loss_position": {r: statistics.median(by[r]) for r in ranks}},
        [_drop(ranks, "the misaligned mask")],
        ranks=ranks,
    )


def unrecorded_loss_shares(ev: Evidence) -> dict[int, float]:
    """Per rank, the share of its loss tokens at positions its routing payload routes no token at (every slot -1);
    {} where the snapshot has no routing payloads or they do not match the batches."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_routing_payload

    shares: dict[int, float] = {}
    for rank in ev.analysis.ranks:
        try:
            mask = load_rank_batch(ev.analysis.path, rank)["loss_mask"] != 0
            routes = load_routing_payload(ev.analysis.path, rank).routed_experts
        except (AxrlError, KeyError, OSError):
            return {}
        if routes.shape[:2] != mask.shape or routes.shape[2] == 0:
            return {}
        unrouted = (routes < 0).flatten(2).all(dim=-1)
        tokens = int(mask.sum())
        if tokens:
            shares[rank] = int((unrouted & mask).sum()) / tokens
    return shares


def mask_over_unrecorded(ev: Evidence) -> Cause | None:
    """Loss masks that cover positions the rank's engine recorded no route for, where another rank's cover none."""
    shares = unrecorded_loss_shares(ev)
    ranks = sorted(
        r
        for r, share in shares.items()
        if share >= UNRECORDED and any(o != r and other * WITNESS_RATIO <= share for o, other in shares.items())
    )
    if not ranks or len(ranks) == len(shares):
        return None
    others = [v for r, v in shares.items() if r not in ranks]
    evidence = [
        f"rank {r}: {100 * shares[r]:.0f} % of its loss tokens sit at positions its engine routed no token at (the "
        f"routing payload is -1 there; {100 * max(others):.0f} % at most on the other ranks): its loss covers tokens "
        "the engine did not generate (padding after the response stopped, or a mask longer than the response)"
        for r in ranks
    ]
    carries, figures = carry(ev, ranks)
    return Cause(
        "mask_misalignment",
        f"loss mask covers positions the engine did not generate on rank {_ranks(ranks)}",
        CARRIES if carries else BASE,
        evidence + figures,
        {"unrecorded_loss_share": {r: shares[r] for r in ranks}},
        [_drop(ranks, "the mask over the unrecorded positions")],
        ranks=ranks,
    )


def _abs_advantages(ev: Evidence) -> dict[int, list[float]]:
    by: dict[int, list[float]] = {}
    for row in ev.analysis.samples["rows"]:
        if row["loss_tokens"] and is_finite(row["advantage"]):
            by.setdefault(row["rank"], []).append(abs(row["advantage"]))
    return {r: v for r, v in by.items() if v}


def scaled_ranks(ev: Evidence) -> dict[int, tuple[float, float]]:
    """{rank: (its typical |advantage|, the other ranks' median)} for ranks on another scale than the others, whose
    data the policy finds as likely as the others' (when that was compared)."""
    values = _abs_advantages(ev)
    typical = {r: statistics.median(v) for r, v in values.items()}
    if len(typical) < 2:
        return {}
    likely = ev.reading.likelihood if ev.reading is not None else {}
    found: dict[int, tuple[float, float]] = {}
    for rank, a in typical.items():
        rest = statistics.median(v for r, v in typical.items() if r != rank)
        largest = max(v for r, vs in values.items() if r != rank for v in vs)
        if not (rest > 0 and a >= SCALE * rest and a > largest):  # only a larger scale carries a spike
            continue
        if rank in likely and len(likely) >= 2:
            others = statistics.median(v for r, v in likely.items() if r != rank)
            if others - likely[rank] >= DATA_NATS:
                continue  # its data differs too: one rank's data, not its advantages alone
        found[rank] = (a, rest)
    return found if len(found) < len(typical) else {}


def rank_advantage_scale(ev: Evidence) -> Cause | None:
    """Advantages on another scale on some ranks, the other ranks' as witnesses, the data alike."""
    scaled = scaled_ranks(ev)
    if not scaled:
        return None
    ranks = sorted(scaled)
    carries, figures = carry(ev, ranks)
    healthy = [abs(r["advantage"]) for r in ev.analysis.samples["rows"] if r["rank"] not in ranks and r["loss_tokens"]]
    healthy = [v for v in healthy if is_finite(v)]
    clip = max(1.0, round(max(healthy, default=1.0), 2))
    evidence = [
        f"rank {r}'s typical |advantage| {a:.4g} is {a / rest if rest > 0 else math.inf:.3g}x the other ranks' "
        f"median {rest:.4g}: its advantages are on another scale (a normalisation, a reward scale or a whitening "
        "that differs on that rank)"
        for r, (a, rest) in sorted(scaled.items())
    ]
    if ev.reading is not None and ev.reading.likelihood:
        evidence.append(f"rank {_ranks(ranks)}'s data is as likely to the policy as the other ranks'")
    return Cause(
        "outlier_advantage",
        f"advantages on another scale on rank {_ranks(ranks)}",
        CARRIES if carries else BASE,
        evidence + figures,
        {
            "typical_abs_advantage": {r: a for r, (a, _) in scaled.items()},
            "others": {r: v for r, (_, v) in scaled.items()},
        },
        [
            Experiment(
                f"advantage_clip={clip:g}",
                f"clamps every advantage to the other ranks' range (|A| at most {clip:g})",
                refutes=REFUTE,
            ),
            _drop(ranks, "the advantage scale"),
        ],
        ranks=ranks,
        term="policy",
    )


def _group_spreads(batch: dict[str, Any]) -> tuple[list[float], int]:
    """(per group of the batch whose advantages differ at all: its advantages' std over max(1, its rewards' std)
    (population stds), the largest group's size); ([], 0) without per-sample rewards, advantages and group ids of one
    length. Samples with no loss token are left out."""
    import torch

    names = ("rewards", "advantages", "group_index")
    if any(not isinstance(batch.get(n), torch.Tensor) or batch[n].dim() != 1 for n in names):
        return [], 0
    rewards, advantages, groups = (batch[n] for n in names)
    if not rewards.shape == advantages.shape == groups.shape:
        return [], 0
    mask = batch.get("loss_mask")
    trained = (
        mask.flatten(1).ne(0).any(dim=1)
        if isinstance(mask, torch.Tensor) and mask.shape[:1] == rewards.shape
        else torch.ones_like(rewards, dtype=torch.bool)
    )
    spreads: list[float] = []
    largest = 0
    for g in groups.unique():
        rows = (groups == g) & trained
        largest = max(largest, int(rows.sum()))
        if int(rows.sum()) < 2:
            continue
        a, r = advantages[rows].double(), rewards[rows].double()
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(r).all())):
            continue
        spread = float(a.std(unbiased=False))
        if spread > 0:
            spreads.append(spread / max(1.0, float(r.std(unbiased=False))))
    return spreads, largest


def overscaled_ranks(ev: Evidence) -> dict[int, tuple[float, int, int, int]]:
    """{rank: (its groups' median spread factor, groups past SPREAD, groups whose advantages differ, its largest
    group)} for the ranks where most such groups are spread SPREAD times wider than their rewards and a
    standardised group allow."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch

    found: dict[int, tuple[float, int, int, int]] = {}
    path, ranks = getattr(ev.analysis, "path", None), getattr(ev.analysis, "ranks", None) or []
    if path is None:
        return {}
    for rank in ranks:
        try:
            spreads, largest = _group_spreads(load_rank_batch(path, rank))
        except (AxrlError, KeyError, OSError):
            return {}
        past = sum(v >= SPREAD for v in spreads)
        if spreads and past * 2 > len(spreads):
            found[rank] = (statistics.median(spreads), past, len(spreads), largest)
    return found


def advantages_past_rewards(ev: Evidence) -> Cause | None:
    """Advantages spread wider within their groups than any usual estimator makes from the groups' rewards."""
    found = overscaled_ranks(ev)
    if not found:
        return None
    every = len(found) == len(getattr(ev.analysis, "ranks", None) or [])
    ranks = [] if every else sorted(found)
    carries, figures = carry(ev, ranks) if ranks else (False, [])
    evidence = [
        f"rank {r}: in {past} of its {n} groups whose advantages differ, the advantages are spread {factor:.3g}x "
        "wider (median) than both a standardised group (std 1) and the group's rewards: no usual estimator (GRPO, "
        "a baseline, RLOO) makes them from those rewards; a scale, a sum or a normalisation differs there"
        for r, (factor, past, n, _) in sorted(found.items())
    ]
    experiments = [standardised_clip(max(g for *_, g in found.values()))]
    if ranks:
        experiments.append(_drop(ranks, "the advantage scale"))
    return Cause(
        "outlier_advantage",
        "advantages wider than their rewards explain" + (f" on rank {_ranks(ranks)}" if ranks else ""),
        CARRIES if carries else BASE,
        evidence + figures,
        {"advantage_spread": {r: v[0] for r, v in found.items()}},
        experiments,
        ranks=ranks,
        term="policy",
    )
