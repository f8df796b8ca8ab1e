"""The cause families `diagnose` weighs, each a pure function of the evidence: a Cause with a strength in
[0, 1], its evidence as numbers and experiments least invasive first (None when the family does not apply).

Strength is a plain-rules score, not a probability: 1.0 means the signal is unmistakable (e.g. a non-finite
grad norm, every advantage negative), LIKELY (0.3) the least that is reported as a likely cause.

Non-finite values are the non_finite family's evidence and no other's: every other family judges the finite
values only (a NaN compares false with every threshold and `min(1.0, nan)` is 1.0, so one NaN would otherwise
pass for the strongest signal), and a strength is never NaN (`unit_strength`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from axrl_spike_replay.diagnosis.evidence.model_evidence import RouteAgreement
from axrl_spike_replay.diagnosis.evidence.signal_reading import SignalReading
from axrl_spike_replay.experiment.result import Attribution
from axrl_spike_replay.experiment.step_evidence import LossChannel
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.training.sample_masks import outlier_z

OUTLIER_GAP = 10.0  # a few outliers whose z is this many times the next one's stand out from many past OUTLIER_Z
F32_NORM_OVERFLOW = math.sqrt(3.4028234663852886e38)  # a float32 sum of squares overflows past this norm
LIKELY = 0.3
OUTLIER_Z = 10.0  # robust z of a sample's advantage that makes it an outlier
FEW = 0.1  # "a few samples": at most this fraction of the batch (and at least one)
LN2 = math.log(2.0)
DUAL_CLIP_C = 3.0  # the dual clip suggested (verl's default clip_ratio_c)


# A cause's figure set by a rule that found its part out of line but the run's loss not (or barely) reading it: what a
# check of the input alone cannot know, so a corrupt input of that part does not lift it back (`input_causes`)
LOSS_READS_LITTLE = "loss_reads_little"


@dataclass
class Experiment:
    """One replay to run: `mitigation` is a ready `--mitigation NAME=VALUE` item; `refutes`: the outcome that would
    refute the cause it tests."""

    mitigation: str
    why: str
    diagnostic_only: bool = False
    refutes: str = ""


def log_ratio_clip() -> Experiment:
    """The clamp of the log-ratio before exp(): for a log-prob that is not finite or one whose distance overflows."""
    return Experiment("log_ratio_clip=5", "clamps the log-ratio before exp(): an overflow becomes finite")


@dataclass
class Cause:
    """One cause family's reading of the evidence (see the package doc for each field)."""

    family: str
    title: str
    strength: float
    evidence: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    experiments: list[Experiment] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    samples: list[tuple[int, int]] = field(default_factory=list)
    term: str | None = None
    tied_with: list[str] = field(default_factory=list)


@dataclass
class Evidence:
    """What the causes are judged on (any part may be missing)."""

    analysis: Any  # BatchAnalysis
    grads: Any | None  # GradReport
    attribution: Attribution | None
    routes: RouteAgreement | None
    world_size: int
    reading: SignalReading | None = None  # the per-rank signal check, read (model evidence)
    channel: LossChannel | None = None  # the gradient by loss term (model evidence)
    loss: LossConfig | None = None  # the run's loss config (None: unreadable)
    routing: RoutingConfig | None = None
    reproduction: Any | None = None  # each rank's record against the replay (`reproduction.Reproduction`)


def percent_text(x: float) -> str:
    """A share as a percentage with one decimal (`12.5 %`), as cause evidence reads."""
    return f"{100 * x:.1f} %"


def is_finite(x: Any) -> TypeGuard[float]:
    """A finite number (not a bool, not None)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def unit_strength(x: float) -> float:
    """A strength in [0, 1]: NaN (from a non-finite figure that slipped through) counts as no signal."""
    return 0.0 if math.isnan(x) else min(1.0, max(0.0, x))


NON_FINITE_INPUTS = 0.6  # non-finite batch values under a finite recorded norm: likely, but not the spike itself


def top_carriers(att: Attribution | None, cover: float = 0.5) -> list[Any]:
    """The top-attributed samples that together carry `cover` of the norm (at most 5)."""
    if att is None:
        return []
    out, total = [], 0.0
    for s in att.samples[:5]:
        if not is_finite(s.share):
            continue
        if s.share <= 0:
            break
        out.append(s)
        total += s.share
        if total >= cover:
            break
    return out


def _row(a: Any, rank: int, sample: int) -> dict[str, Any] | None:
    for r in a.samples["rows"]:
        if r["rank"] == rank and r["sample"] == sample:
            return r
    return None


def sample_pairs(samples: list[tuple[int, int]]) -> str:
    """Samples as `rank:sample` pairs joined by commas, as the mask mitigations take them."""
    return ",".join(f"{r}:{s}" for r, s in samples)


def non_finite(ev: Evidence) -> Cause | None:
    """Non-finite grad norms or batch values. Strength 1.0 when a recorded norm is not finite; non-finite batch
    values under a finite recorded norm are NON_FINITE_INPUTS: they did not reach that gradient as saved.

    A rank's per-parameter norms that are not finite under a finite recorded global norm large enough for a
    float32 norm to overflow (F32_NORM_OVERFLOW, with the rank's part at most world size times the mean) are no
    finding: the DP-reduced gradient holds every rank's, so that rank's gradient was finite and only its norm (the
    trainer's float32 per-parameter norm of a huge gradient) overflowed; the spike's size is what the other
    families read. Under a small global norm an infinite local norm is inconsistent, and reported."""
    a, found = ev.analysis, []
    norm_bad = not math.isfinite(a.grad_norm)
    if norm_bad:
        found.append(f"recorded grad norm is {a.grad_norm}")
    for name, doc in (a.logprobs or {}).items():
        if isinstance(doc, dict) and doc.get("non_finite"):
            found.append(f"{doc['non_finite']} non-finite {name} logprobs on loss tokens")
    logprobs_bad = len(found) > int(norm_bad)
    advantages_bad = bool(a.advantages and a.advantages["tokens"].get("non_finite"))
    if advantages_bad:
        found.append(f"{a.advantages['tokens']['non_finite']} non-finite advantages on loss tokens")
    groups = nan_reward_groups(a.samples["rows"])
    if groups:
        found.append(
            f"rewards that are not finite on sample {sample_pairs(sorted(groups))}: a group estimator (GRPO, RLOO, a "
            "group baseline) makes every advantage of such a sample's group non-finite"
        )
    overflowed: list[int] = []
    if ev.grads is not None:
        for k in ev.grads.ranks:
            if math.isfinite(k.local_grad_norm):
                continue
            if math.isfinite(a.grad_norm) and a.grad_norm * max(ev.world_size, 1) >= F32_NORM_OVERFLOW:
                overflowed.append(k.rank)
                continue
            norm_bad = True
            found.append(f"rank {k.rank}'s recorded per-parameter grad norms are not finite")
    if not found:
        return None
    figures = {"findings": len(found), "recorded_norm_finite": not norm_bad}
    if not norm_bad:
        found.append(
            f"the recorded grad norm {a.grad_norm:.4g} is finite: these values did not enter the recorded step's "
            "gradient as saved (the trainer masked or replaced them, or the saved batch is not the one it trained on)"
        )
    bad = [(r["rank"], r["sample"]) for r in a.samples["rows"] if r["loss_tokens"] and _non_finite_row(r, a)]
    bad = sorted(set(bad) | {p for pairs in groups.values() for p in pairs})  # the NaN reward's whole group
    # every stored input finite: the non-finite values arose in the step (`overflow` reads which input drives them)
    figures["inputs_finite"] = not (logprobs_bad or advantages_bad or groups or bad)
    experiments = []
    # a stored log-prob that is not finite: clamping the log-ratio before exp() keeps an inf out of the ratio. A
    # non-finite norm from finite inputs gets the clamp only where a log-prob drives an overflow
    # (`overflow.symptom_of_overflow`): a division by zero in the trainer is no overflow, and the clamp a no-op there
    if logprobs_bad:
        experiments.append(log_ratio_clip())
    if bad and len(bad) * 2 <= len(a.samples["rows"]):  # every one of them: a NaN left in keeps the step NaN
        what = "the samples with non-finite values" + (" and the groups of the non-finite rewards" if groups else "")
        experiments.append(
            Experiment(
                f"drop_samples={sample_pairs(bad)}",
                f"leave out {what}: if the step is finite without them, they are the cause",
                True,
                refutes="the step stays non-finite (or the spike stays) without them",
            )
        )
    strength = 1.0 if norm_bad else NON_FINITE_INPUTS
    # the ranks that hold them (none named when every saved rank does: nothing to single out)
    hit = {r for r, _ in bad}
    if ev.grads is not None:
        hit |= {k.rank for k in ev.grads.ranks if not math.isfinite(k.local_grad_norm) and k.rank not in overflowed}
    ranks = sorted(hit) if len(hit) < len(a.ranks) else []
    return Cause("non_finite", "non-finite values", strength, found, figures, experiments, ranks=ranks)


def nan_reward_groups(rows: list[dict[str, Any]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """{(rank, sample) whose reward is not finite: the (rank, sample) pairs of its prompt group on that rank (itself
    alone without a group id)}, on the ranks where some reward is finite (a batch that stores no rewards has none to
    read)."""
    read = {r["rank"] for r in rows if is_finite(r.get("reward"))}
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for row in rows:
        if row["rank"] not in read or is_finite(row.get("reward")):
            continue
        group = row.get("group")
        out[(row["rank"], row["sample"])] = [
            (o["rank"], o["sample"])
            for o in rows
            if o["rank"] == row["rank"] and (o is row or (group is not None and o.get("group") == group))
        ]
    return out


def _non_finite_row(row: dict[str, Any], a: Any) -> bool:
    """A sample whose log-ratio or advantage is non-finite (a NaN is stored as None in the sample rows)."""
    ratio_bad = a.ratio_old_vs_rollout.get("available") and not is_finite(row["max_abs_log_ratio_old_vs_rollout"])
    advantage_bad = a.advantages is not None and not is_finite(row["advantage"])
    return bool(ratio_bad or advantage_bad)


def finite_fraction_outside(ratio: dict[str, Any]) -> float | None:
    """The fraction of finite loss-token log-ratios outside [ln 0.5, ln 2] (analyze counts a non-finite one as
    outside; here it is left out); None when no log-ratio is finite."""
    stats = ratio["log_ratio"]
    count, non_finite = int(stats.get("count") or 0), int(stats.get("non_finite") or 0)
    finite = count - non_finite
    if finite <= 0:
        return None
    outside = round(ratio["fraction_outside"]["0.5-2.0"] * count) - non_finite
    return max(0, outside) / finite


def _outliers(a: Any) -> tuple[list[dict[str, Any]], list[float], list[int]]:
    """(samples with loss tokens and an advantage, their robust z, indexes of the few outliers by z). The z is
    `advantage_outlier_mask`'s own (`outlier_z` over each saved rank's batch, with its prompt groups), so the
    threshold a suggestion names is judged on the figure the mask measures."""
    rows = [r for r in a.samples["rows"] if is_finite(r["advantage"]) and r["loss_tokens"]]
    z = [0.0] * len(rows)
    by_rank: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_rank.setdefault(r["rank"], []).append(i)
    for index in by_rank.values():
        groups = [rows[i].get("group") for i in index]
        keys = groups if all(g is not None for g in groups) else None
        for i, score in zip(index, outlier_z([rows[i]["advantage"] for i in index], keys), strict=True):
            z[i] = score
    outliers = sorted((i for i in range(len(rows)) if z[i] >= OUTLIER_Z), key=lambda i: -z[i])
    few = max(1, int(FEW * len(rows)))
    if len(outliers) > few:
        # many past the threshold: still a few outliers when those few stand OUTLIER_GAP times beyond the rest
        # (a reward on another scale beside a group whose one right answer reads as z 12)
        cut = next((k for k in range(1, few + 1) if z[outliers[k - 1]] >= OUTLIER_GAP * z[outliers[k]]), None)
        return rows, z, outliers[:cut] if cut is not None else []
    return rows, z, outliers


def _outlier_pairs(a: Any) -> set[tuple[int, int]]:
    rows, _, outliers = _outliers(a)
    return {(rows[i]["rank"], rows[i]["sample"]) for i in outliers}


def outlier_advantage(ev: Evidence) -> Cause | None:
    a = ev.analysis
    rows, z, outliers = _outliers(a)
    if not outliers:
        return None
    order = sorted(range(len(rows)), key=lambda i: -z[i])
    rest = max((z[i] for i in order if z[i] < OUTLIER_Z), default=1.0)  # the mask flags z > threshold
    threshold = max(5, round(math.sqrt(max(rest, 1.0) * z[outliers[-1]])))  # between the rest and the outliers
    pairs = [(rows[i]["rank"], rows[i]["sample"]) for i in outliers]
    advs = [rows[i]["advantage"] for i in outliers]
    others = [abs(r["advantage"]) for i, r in enumerate(rows) if i not in outliers]
    evidence = [
        f"{len(outliers)} of {len(rows)} samples have an outlier advantage: "
        + ", ".join(
            f"rank {r} sample {s} advantage {v:.4g} (robust z {z[i]:.3g})"
            for (r, s), v, i in zip(pairs, advs, outliers, strict=True)
        )
        + f"; the other samples' |advantage| at most {max(others, default=0.0):.3g}"
    ]
    strength = 0.6
    shares = [s.share for s in (ev.attribution.samples if ev.attribution else []) if (s.rank, s.sample) in pairs]
    carried = math.fsum(x for x in shares if is_finite(x))
    if ev.attribution is not None:
        evidence.insert(
            0,
            f"{'sample' if len(pairs) == 1 else 'these samples'} {sample_pairs(pairs)} carr"
            f"{'ies' if len(pairs) == 1 else 'y'} {percent_text(carried)} of ‖g‖",
        )
        strength = 0.4 + 0.6 * unit_strength(carried)
    return Cause(
        "outlier_advantage",
        "outlier advantage on a few samples",
        strength,
        evidence,
        {
            "samples": [list(p) for p in pairs],
            "advantages": advs,
            "robust_z": [z[i] for i in outliers],
            "share_of_norm": carried if ev.attribution else None,
        },
        [
            Experiment(
                f"advantage_outlier_mask={threshold}",
                f"masks samples whose advantage is a robust outlier (z above {threshold}) within its rank's batch: "
                f"these samples' z {', '.join(f'{z[i]:.3g}' for i in outliers)}, the others' at most {rest:.3g}",
                refutes="the spike stays within 20 % of the baseline",
            ),
            Experiment(
                f"drop_samples={sample_pairs(pairs)}",
                "leaves these samples out: if the spike goes, they are the cause (diagnostic, not a production method)",
                True,
                refutes="the spike stays within 20 % of the baseline",
            ),
            Experiment(
                f"advantage_clip={max(1.0, round(max(others, default=1.0), 2)):g}",
                "clamps every advantage to the healthy samples' range",
                refutes="the spike stays within 20 % of the baseline",
            ),
        ],
        ranks=sorted({r for r, _ in pairs}),
        samples=pairs,
        term="policy",
    )


def negative_advantage_dominance(ev: Evidence) -> Cause | None:
    s = ev.analysis.sign_balance
    if not s:
        return None
    ratio = s["negative_to_positive"]
    if ratio is None or math.isnan(ratio) or ratio < 1.5:  # the totals are of finite advantages (analyze)
        return None
    outliers = _outlier_pairs(ev.analysis)
    rows = [r for r in ev.analysis.samples["rows"] if is_finite(r["advantage"])]
    if outliers:  # a few outlier samples can tip the balance alone: judge the rest of the batch
        rows = [r for r in rows if (r["rank"], r["sample"]) not in outliers]
        ratio = _sign_ratio(rows)
        if ratio < 1.5:
            return None
    strength = 1.0 if math.isinf(ratio) else unit_strength((ratio - 1.0) / 4.0)
    neg_tokens = s["negative_tokens"] / max(1, s["negative_tokens"] + s["positive_tokens"] + s["zero_tokens"])
    skipped = s.get("non_finite_tokens") or 0
    evidence = [
        f"negative advantages outweigh positive ones {'entirely' if math.isinf(ratio) else f'{ratio:.3g}x'} "
        f"(totals per loss token {s['negative_total']:.4g} vs {s['positive_total']:.4g}); "
        f"{percent_text(neg_tokens)} of loss tokens have a negative advantage"
        + (f" ({skipped} non-finite left out)" if skipped else "")
    ]
    if ev.attribution is not None:
        neg = math.fsum(x.share for x in ev.attribution.samples if x.advantage < 0 and is_finite(x.share))
        evidence.append(
            f"negative-advantage samples among the top {len(ev.attribution.samples)} carry {percent_text(neg)} of ‖g‖"
        )
    experiments = [
        Experiment("balance_negative_advantages=true", "scales negative advantages to the positives' total"),
        Experiment("advantage_clip=1", "clamps advantages to [-1, 1]"),
    ]
    ranks, rest = tipping_ranks(rows)
    if ranks:
        where = ",".join(str(r) for r in ranks)
        evidence.append(
            f"rank {where} tips the balance: without its samples the other ranks' negative advantages weigh "
            f"{rest:.3g}x their positive ones, a balance that does not dominate"
        )
        experiments.append(
            Experiment(f"drop_ranks={where}", f"leaves rank {where}'s samples out: if the spike goes, they carry it")
        )
    tipping = tipping_samples(rows, ranks)
    if tipping:
        experiments.append(
            Experiment(
                f"drop_samples={sample_pairs(tipping)}",
                f"leaves out the {len(tipping)} most negative samples"
                + (f" of rank {','.join(str(r) for r in ranks)}" if ranks else "")
                + ", the fewest whose removal leaves the sign balance under 1.5: if the spike goes, the negative "
                "advantages carry it",
                True,
                refutes="the spike stays without the samples that tip the sign balance",
            )
        )
    peak = _peak_log_ratio(ev)
    if peak is None or peak > math.log(DUAL_CLIP_C):
        experiments.append(
            Experiment(
                f"dual_clip_c={DUAL_CLIP_C:g}",
                "caps the loss of negative-advantage tokens whose ratio exceeds "
                f"{DUAL_CLIP_C:g}"
                + ("" if peak is None else f" (max |log π - log π_base| at the snapshot's weights {peak:.3g})"),
            )
        )
    else:  # the ratio stays within [1/c, c] on every loss token: the cap would bind nowhere
        evidence.append(
            f"every loss token's ratio π/π_base stays within [1/{DUAL_CLIP_C:g}, {DUAL_CLIP_C:g}] at the snapshot's "
            f"weights (max |log-ratio| {peak:.3g}): dual_clip_c={DUAL_CLIP_C:g} would change nothing"
        )
    return Cause(
        "negative_advantage_dominance",
        "negative-advantage dominance",
        strength,
        evidence,
        {"negative_to_positive": ratio, "negative_token_fraction": neg_tokens},
        experiments,
        ranks=ranks,
        term="policy" if ranks else None,
    )


def _sign_ratio(rows: list[dict[str, Any]]) -> float:
    """Negative over positive advantage totals per loss token of these sample rows (inf: negatives only)."""
    pos = math.fsum(max(0.0, r["advantage"]) * r["loss_tokens"] for r in rows)
    neg = math.fsum(max(0.0, -r["advantage"]) * r["loss_tokens"] for r in rows)
    return neg / pos if pos else (math.inf if neg else 0.0)


def tipping_samples(rows: list[dict[str, Any]], ranks: list[int]) -> list[tuple[int, int]]:
    """The fewest samples, at most half of the batch, on `ranks` (every rank when empty) whose removal leaves the
    batch's sign balance under 1.5, most negative (advantage times loss tokens) first, as (rank, sample) sorted;
    [] when no such few samples do."""
    if _sign_ratio(rows) < 1.5:
        return []
    scope = [r for r in rows if r["loss_tokens"] and r["advantage"] < 0 and (not ranks or r["rank"] in ranks)]
    order = sorted(scope, key=lambda r: r["advantage"] * r["loss_tokens"])
    taken: set[tuple[int, int]] = set()
    for row in order[: len(rows) // 2]:
        taken.add((row["rank"], row["sample"]))
        if _sign_ratio([r for r in rows if (r["rank"], r["sample"]) not in taken]) < 1.5:
            whole = {(r["rank"], r["sample"]) for r in rows if r["loss_tokens"] and r["rank"] in ranks}
            return [] if taken == whole else sorted(taken)  # every sample of the ranks: `drop_ranks` tests that
    return []


def tipping_ranks(rows: list[dict[str, Any]]) -> tuple[list[int], float]:
    """The fewest ranks, at most half of them, whose samples tip the batch's sign balance (the ranks whose negative
    advantages most outweigh their positive ones, taken out one by one until the rest's balance is under 1.5), with
    the rest's balance; ([], 0.0) when no such few ranks do: the balance is the batch's over every rank."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["rank"], []).append(r)
    if len(by) < 2:
        return [], 0.0

    def net(rank: int) -> float:
        return math.fsum(-r["advantage"] * r["loss_tokens"] for r in by[rank])

    order = sorted(by, key=net, reverse=True)
    for k in range(1, len(order) // 2 + 1):
        taken, left = order[:k], order[k:]
        rest = _sign_ratio([r for rank in left for r in by[rank]])
        if rest < 1.5:
            if _sign_ratio([r for rank in taken for r in by[rank]]) < 1.5:
                return [], 0.0
            return sorted(taken), rest
    return [], 0.0


def _peak_log_ratio(ev: Evidence) -> float | None:
    """The largest |log π - log π_base| over every rank's loss tokens at the snapshot's weights, where π_base is the
    log-prob the run's PPO ratio is taken against (None: no replay, or that signal was not compared)."""
    if ev.reading is None:
        return None
    loss = ev.loss
    base = "old"
    if loss is not None and loss.convention != "verl" and loss.mismatch_token_clip_max is None:
        base = loss.is_base_logprobs
    pairs = [v.current_pair for v in ev.reading.levels.get(base, {}).values() if v.current_pair is not None]
    return max((p.max_abs for p in pairs), default=None) if pairs else None
