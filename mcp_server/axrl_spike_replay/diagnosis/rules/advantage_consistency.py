"""The advantages each rank stored, held to its own stored rewards under the advantage estimator the run config
records (`train.advantage_estimator`): a self-consistency check of the batch, so it needs no other rank as a
witness (it holds where every other rank's advantages are 0).

What the estimator says of a group (the samples of one prompt, `group_index`), whatever its scale and normalisation:

- the group-relative estimators (`GROUP_CENTRED`: GRPO with or without the std, Dr. GRPO, RLOO) subtract the group's
  mean reward (RLOO: the other samples'), so a group's advantages have mean 0, and a group of equal rewards has
  advantages 0. A group whose advantages' mean is off 0 by `CENTRE` times their spread, or by `CENTRE` where they
  spread less than 1 (a standardised group's values are of order 1), is not centred;
- every outcome estimator of `REWARD_ORDERED` (those, and a running or a greedy baseline) makes a sample's advantage
  an increasing function of its reward within its group: two samples whose advantages are ordered against their
  rewards, or differ where their rewards tie (beyond `ORDER_TOL` of the group's largest |advantage|), are out of
  order.

Only complete groups are judged: groups of the recorded `train.group_size` (without it, every group of the snapshot
one size), whose id no other rank holds (a group split over ranks has a partial mean). A rank with a group that
fails has advantages its rewards do not give under the recorded estimator: `outlier_advantage` on that rank, as
strong as the share of the gradient it carries says (`rank_inputs.carry`: `CARRIES`, else `BASE`). On every rank it
stays at `BASE`: a run config that records another estimator than the trainer ran would read the same; so it does
where every group off centre is off below 0 (and none out of order): advantages that lean negative are what
`negative_advantage_dominance` reads too. An estimator the run config does not record, or none of these, is not
judged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.diagnosis.rules.causes import Cause, Evidence, Experiment
from axrl_spike_replay.diagnosis.rules.rank_inputs import BASE, CARRIES, REFUTE, carry, standardised_clip

GROUP_CENTRED = ("grpo", "grpo_vectorized", "dr_grpo", "rloo")
REWARD_ORDERED = (*GROUP_CENTRED, "reinforce_baseline", "remax")
CENTRE = 0.5  # a group's |mean advantage| past this many times max(1, its advantages' std): not centred
ORDER_TOL = 1e-3  # advantages this close (times max(1, the group's largest |advantage|)) count as tied


@dataclass
class RankConsistency:
    """One rank's groups against the recorded estimator: `groups` judged, those `off_centre` ((group id, mean
    advantage, whether its rewards all tie)), those `disordered` ((group id, pairs of samples out of order))."""

    rank: int
    groups: int = 0
    off_centre: list[tuple[int, float, bool]] = field(default_factory=list)
    disordered: list[tuple[int, int]] = field(default_factory=list)

    @property
    def failing(self) -> int:
        """How many of its groups fail either check."""
        return len({g for g, *_ in self.off_centre} | {g for g, _ in self.disordered})


def recorded_estimator(path: Path) -> tuple[str, int | None] | None:
    """(the run config's `train.advantage_estimator`, its `train.group_size` when a whole number >= 2), or None where
    the run config is unreadable or records no estimator."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.replay.reading.inputs import read_run_config

    try:
        train = read_run_config(path).get("train")
    except (AxrlError, OSError):
        return None
    if not isinstance(train, dict) or not isinstance(train.get("advantage_estimator"), str):
        return None
    size = train.get("group_size")
    whole = isinstance(size, int) and not isinstance(size, bool) and size >= 2
    return train["advantage_estimator"].strip().lower(), size if whole else None


def _groups(batch: dict[str, Any]) -> dict[int, tuple[list[float], list[float]]] | None:
    """{group id: (rewards, advantages)} of a batch with per-sample rewards, advantages and group ids of one length
    (every sample: the estimator saw them all), or None without them."""
    import torch

    names = ("rewards", "advantages", "group_index")
    if any(not isinstance(batch.get(n), torch.Tensor) or batch[n].dim() != 1 for n in names):
        return None
    rewards, advantages, ids = (batch[n] for n in names)
    if not rewards.shape == advantages.shape == ids.shape or ids.is_floating_point():
        return None
    out: dict[int, tuple[list[float], list[float]]] = {}
    for g, r, a in zip(ids.tolist(), rewards.double().tolist(), advantages.double().tolist(), strict=True):
        rs, As = out.setdefault(int(g), ([], []))
        rs.append(r)
        As.append(a)
    return out


def _disordered_pairs(rewards: Sequence[float], advantages: Sequence[float]) -> int:
    """Pairs of samples whose advantages are ordered against their rewards, or differ where their rewards tie."""
    tol = ORDER_TOL * max(1.0, max(abs(a) for a in advantages))
    bad = 0
    for i in range(len(rewards)):
        for j in range(i + 1, len(rewards)):
            (ri, ai), (rj, aj) = sorted(((rewards[i], advantages[i]), (rewards[j], advantages[j])))
            bad += (abs(ai - aj) > tol) if ri == rj else (ai > aj + tol)
    return bad


def _judge(rank: int, groups: dict[int, tuple[list[float], list[float]]], centred: bool) -> RankConsistency:
    found = RankConsistency(rank)
    for g, (rewards, advantages) in sorted(groups.items()):
        if not all(math.isfinite(x) for x in (*rewards, *advantages)):
            continue  # non-finite values are the non_finite family's
        found.groups += 1
        n = len(advantages)
        mean = math.fsum(advantages) / n
        spread = math.sqrt(math.fsum((a - mean) ** 2 for a in advantages) / n)
        if centred and abs(mean) > CENTRE * max(1.0, spread):
            found.off_centre.append((g, mean, max(rewards) == min(rewards)))
        pairs = _disordered_pairs(rewards, advantages)
        if pairs:
            found.disordered.append((g, pairs))
    return found


def inconsistent_ranks(ev: Evidence) -> tuple[str, int, dict[int, RankConsistency]]:
    """(the recorded estimator, the size of the groups judged, {rank: its findings} for the ranks with a group its
    rewards do not explain); ("", 0, {}) where the estimator is not recorded or not one of REWARD_ORDERED, or the
    batches lack rewards, advantages or group ids."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch

    path, ranks = getattr(ev.analysis, "path", None), getattr(ev.analysis, "ranks", None) or []
    if path is None:
        return "", 0, {}
    recorded = recorded_estimator(Path(path))
    if recorded is None or recorded[0] not in REWARD_ORDERED:
        return "", 0, {}
    estimator, size = recorded
    by_rank: dict[int, dict[int, tuple[list[float], list[float]]]] = {}
    for rank in ranks:
        try:
            groups = _groups(load_rank_batch(path, rank))
        except (AxrlError, KeyError, OSError):
            return "", 0, {}
        if groups is None:
            return "", 0, {}
        by_rank[rank] = groups
    held: dict[int, int] = {}
    for groups in by_rank.values():
        for g in groups:
            held[g] = held.get(g, 0) + 1
    sizes = {len(r) for groups in by_rank.values() for r, _ in groups.values()}
    if size is None and len(sizes) != 1:
        return estimator, 0, {}  # groups of several sizes and none recorded: which are complete is not known
    want = size if size is not None else next(iter(sizes))
    found: dict[int, RankConsistency] = {}
    for rank, groups in by_rank.items():
        whole = {g: v for g, v in groups.items() if held[g] == 1 and len(v[0]) == want and want >= 2}
        judged = _judge(rank, whole, estimator in GROUP_CENTRED)
        if judged.failing:
            found[rank] = judged
    return estimator, want, found


def _sentence(c: RankConsistency, estimator: str) -> str:
    parts: list[str] = []
    if c.off_centre:
        means = sorted((abs(m) for _, m, _ in c.off_centre), reverse=True)
        size = f"{means[0]:.4g}" if len(means) == 1 else f"{means[-1]:.4g} to {means[0]:.4g}"
        tied = [abs(m) for _, m, t in c.off_centre if t]
        parts.append(
            f"in {len(c.off_centre)} of its {c.groups} groups the advantages' mean is not 0 (|mean| {size}), where "
            "the estimator subtracts the group's mean reward"
            + (
                f"; {len(tied)} of them of equal rewards, whose advantages should all be 0, hold up to {max(tied):.4g}"
                if tied
                else ""
            )
        )
    if c.disordered:
        pairs = sum(p for _, p in c.disordered)
        parts.append(
            f"in {len(c.disordered)} of its {c.groups} groups the advantages do not follow the rewards' order "
            f"({pairs} pairs of samples ordered against their rewards, or apart where the rewards tie)"
        )
    return (
        f"rank {c.rank}'s advantages against its own rewards under the run's {estimator} estimator: "
        + "; ".join(parts)
        + ": that estimator does not make these advantages from these rewards"
    )


def advantages_against_rewards(ev: Evidence) -> Cause | None:
    """Stored advantages that the recorded estimator does not make from the same rank's stored rewards."""
    estimator, size, found = inconsistent_ranks(ev)
    if not found:
        return None
    every = len(found) == len(getattr(ev.analysis, "ranks", None) or [])
    ranks = [] if every else sorted(found)
    carries, figures = carry(ev, ranks) if ranks else (False, [])
    evidence = [_sentence(c, estimator) for _, c in sorted(found.items())]
    if every:
        evidence.append(
            "on every rank: advantages made another way everywhere, or a run config that records another estimator "
            "than the trainer ran"
        )
    offsets = [m for c in found.values() for _, m, _ in c.off_centre]
    below = bool(offsets) and all(m < 0 for m in offsets) and not any(c.disordered for c in found.values())
    if below:
        evidence.append(
            "every group off centre is off below 0: the advantages lean negative, as negative-advantage dominance "
            "reads them; `advantage_clip` against `balance_negative_advantages` tells the two readings apart"
        )
    where = ",".join(str(r) for r in ranks)
    experiments = [standardised_clip(size)]
    if ranks:
        experiments.append(
            Experiment(
                f"drop_ranks={where}",
                f"leaves rank {where}'s samples out: if the spike goes, its advantages are the cause",
                True,
                refutes=REFUTE,
            )
        )
    return Cause(
        "outlier_advantage",
        "advantages their own rewards do not give" + (f" on rank {where}" if ranks else ""),
        CARRIES if carries and not every and not below else BASE,
        evidence + figures,
        {
            "estimator": estimator,
            "groups": {r: c.groups for r, c in found.items()},
            "groups_failing": {r: c.failing for r, c in found.items()},
            "off_centre": {r: [m for _, m, _ in c.off_centre] for r, c in found.items()},
            "disordered_pairs": {r: sum(p for _, p in c.disordered) for r, c in found.items()},
        },
        experiments,
        ranks=ranks,
        term="policy",
    )


def corroborated(found: Cause | None, own: Cause | None) -> Cause | None:
    """`found` (another reading of the advantages: a few samples' outliers, a rank's scale) with `own` (this check's
    finding) joined to it where `own` names every rank it names (both none: every rank): it keeps its own samples,
    title and experiments, at the stronger of the two strengths, with `own`'s evidence and figures added; else the
    stronger of the two."""
    if own is None or found is None:
        return own if found is None else found
    if set(found.ranks) <= set(own.ranks) and bool(found.ranks) == bool(own.ranks):
        found.strength = max(found.strength, own.strength)
        found.evidence += own.evidence
        found.figures["against_own_rewards"] = own.figures
        return found
    return max((found, own), key=lambda c: c.strength)
