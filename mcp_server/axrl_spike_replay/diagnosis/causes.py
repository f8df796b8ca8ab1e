"""The cause families `diagnose` weighs, each a pure function of the evidence: a Cause with a strength in
[0, 1], its evidence as numbers and experiments least invasive first (None when the family does not apply).

Strength is a plain-rules score, not a probability: 1.0 means the signal is unmistakable (e.g. a non-finite
grad norm, every advantage negative), LIKELY (0.3) the least that is reported as a likely cause.

Non-finite values are the non_finite family's evidence and no other's: every other family judges the finite
values only (a NaN compares false with every threshold and `min(1.0, nan)` is 1.0, so one NaN would otherwise
pass for the strongest signal), and a strength is never NaN (`_unit`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from axrl_spike_replay.diagnosis.model_evidence import RouteAgreement
from axrl_spike_replay.experiment.result import Attribution

LIKELY = 0.3
OUTLIER_Z = 10.0  # robust z of a sample's advantage that makes it an outlier
FEW = 0.1  # "a few samples": at most this fraction of the batch (and at least one)
LN2 = math.log(2.0)


@dataclass
class Experiment:
    """One replay to run: `mitigation` is a ready `--mitigation NAME=VALUE` item."""

    mitigation: str
    why: str
    diagnostic_only: bool = False


@dataclass
class Cause:
    family: str
    title: str
    strength: float
    evidence: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    experiments: list[Experiment] = field(default_factory=list)


@dataclass
class Evidence:
    """What the causes are judged on (any part may be missing)."""

    analysis: Any  # BatchAnalysis
    grads: Any | None  # GradReport
    attribution: Attribution | None
    routes: RouteAgreement | None
    world_size: int


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _finite(x: Any) -> TypeGuard[float]:
    """A finite number (not a bool, not None)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _unit(x: float) -> float:
    """A strength in [0, 1]: NaN (from a non-finite figure that slipped through) counts as no signal."""
    return 0.0 if math.isnan(x) else min(1.0, max(0.0, x))


NON_FINITE_INPUTS = 0.6  # non-finite batch values under a finite recorded norm: likely, but not the spike itself


def _carriers(att: Attribution | None, cover: float = 0.5) -> list[Any]:
    """The top-attributed samples that together carry `cover` of the norm (at most 5)."""
    if att is None:
        return []
    out, total = [], 0.0
    for s in att.samples[:5]:
        if not _finite(s.share):
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


def _pairs(samples: list[tuple[int, int]]) -> str:
    return ",".join(f"{r}:{s}" for r, s in samples)


def non_finite(ev: Evidence) -> Cause | None:
    """Non-finite grad norms or batch values. Strength 1.0 when a recorded norm is not finite; non-finite batch
    values under a finite recorded norm are NON_FINITE_INPUTS: they did not reach that gradient as saved."""
    a, found = ev.analysis, []
    norm_bad = not math.isfinite(a.grad_norm)
    if norm_bad:
        found.append(f"recorded grad norm is {a.grad_norm}")
    for name, doc in (a.logprobs or {}).items():
        if isinstance(doc, dict) and doc.get("non_finite"):
            found.append(f"{doc['non_finite']} non-finite {name} logprobs on loss tokens")
    logprobs_bad = len(found) > int(norm_bad)
    if a.advantages and a.advantages["tokens"].get("non_finite"):
        found.append(f"{a.advantages['tokens']['non_finite']} non-finite advantages on loss tokens")
    if ev.grads is not None:
        for k in ev.grads.ranks:
            if not math.isfinite(k.local_grad_norm):
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
    experiments = []
    if norm_bad or logprobs_bad:  # exp() of a log-ratio may have overflowed
        experiments.append(
            Experiment("log_ratio_clip=5", "clamps the log-ratio before exp(): an overflow becomes finite")
        )
    if bad and len(bad) <= max(1, int(FEW * len(a.samples["rows"]))):
        experiments.append(
            Experiment(
                f"drop_samples={_pairs(bad[:8])}",
                "leave out the samples with non-finite values: if the step is finite without them, they are the cause",
                True,
            )
        )
    strength = 1.0 if norm_bad else NON_FINITE_INPUTS
    return Cause("non_finite", "non-finite values", strength, found, figures, experiments)


def _non_finite_row(row: dict[str, Any], a: Any) -> bool:
    """A sample whose log-ratio or advantage is non-finite (a NaN is stored as None in the sample rows)."""
    ratio_bad = a.ratio.get("available") and not _finite(row["max_abs_log_ratio"])
    advantage_bad = a.advantages is not None and not _finite(row["advantage"])
    return bool(ratio_bad or advantage_bad)


def logprob_mismatch(ev: Evidence) -> Cause | None:
    a = ev.analysis
    if not a.ratio.get("available"):
        return None
    top = a.ratio["abs_log_ratio"].get("max") or 0.0  # of the finite values (stats.describe)
    outside = _finite_fraction_outside(a.ratio)
    if outside is None:
        return None  # no finite log-ratio: the non_finite family reports it
    strength = 0.5 * min(1.0, outside / 0.05) + 0.3 * min(1.0, top / math.log(10.0))
    evidence = [
        f"max |log(π_old/π_rollout)| on loss tokens {top:.3g} (ratio up to {math.exp(min(top, 700)):.3g}x)",
        f"{_pct(outside)} of loss tokens have π_old/π_rollout outside [0.5, 2]",
    ]
    carriers = _carriers(ev.attribution)
    carried: list[str] = []  # largest share first, ahead of the batch-wide figures
    for s in carriers:
        row = _row(a, s.rank, s.sample)
        lr = row["max_abs_log_ratio"] if row else None
        if _finite(lr) and lr > LN2:
            strength += 0.2 / len(carriers)
            carried.append(
                f"rank {s.rank} sample {s.sample} carries {_pct(s.share)} of ‖g‖; its tokens' "
                f"|log(π_old/π_rollout)| up to {lr:.3g}"
            )
    evidence = carried + evidence
    if strength < 0.05:
        return None
    return Cause(
        "logprob_mismatch",
        "rollout/trainer log-prob mismatch",
        _unit(strength),
        evidence,
        {"max_abs_log_ratio": top, "fraction_outside_0.5_2": outside},
        [
            Experiment(
                "mismatch_token_clip_max=2",
                "truncated importance sampling: caps each token's weight min(π_old/π_rollout, 2), the standard fix",
            ),
            Experiment("ratio_outlier_mask=token", "masks the tokens whose ratio leaves [0.5, 2] instead of capping"),
            Experiment(
                "is_base_logprobs=old",
                "takes the PPO ratio against the trainer's own logprobs: shows "
                "whether the rollout logprobs are the problem",
            ),
        ],
    )


def _finite_fraction_outside(ratio: dict[str, Any]) -> float | None:
    """The fraction of finite loss-token log-ratios outside [ln 0.5, ln 2] (analyze counts a non-finite one as
    outside; here it is left out); None when no log-ratio is finite."""
    stats = ratio["log_ratio"]
    count, non_finite = int(stats.get("count") or 0), int(stats.get("non_finite") or 0)
    finite = count - non_finite
    if finite <= 0:
        return None
    outside = round(ratio["fraction_outside"]["0.5-2.0"] * count) - non_finite
    return max(0, outside) / finite


def _robust_z(values: list[float]) -> list[float]:
    med = statistics.median(values)
    dev = [abs(v - med) for v in values]
    scale = 1.4826 * statistics.median(dev)
    if scale <= 0:
        nonzero = [d for d in dev if d > 0]
        scale = statistics.fmean(dev) if nonzero else 0.0
    scale = max(scale, 1e-3 * max(abs(med), 1e-12))  # all but equal: no outlier
    return [d / scale for d in dev]


def _outliers(a: Any) -> tuple[list[dict[str, Any]], list[float], list[int]]:
    """(samples with loss tokens and an advantage, their robust z, indexes of the few outliers by z)."""
    rows = [r for r in a.samples["rows"] if _finite(r["advantage"]) and r["loss_tokens"]]
    if len(rows) < 3:
        return rows, [], []
    z = _robust_z([r["advantage"] for r in rows])
    outliers = sorted((i for i in range(len(rows)) if z[i] >= OUTLIER_Z), key=lambda i: -z[i])
    if len(outliers) > max(1, int(FEW * len(rows))):
        return rows, z, []
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
    rest = max((z[i] for i in order if z[i] < OUTLIER_Z), default=1.0)
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
    carried = math.fsum(x for x in shares if _finite(x))
    if ev.attribution is not None:
        evidence.insert(
            0,
            f"{'sample' if len(pairs) == 1 else 'these samples'} {_pairs(pairs)} carr"
            f"{'ies' if len(pairs) == 1 else 'y'} {_pct(carried)} of ‖g‖",
        )
        strength = 0.4 + 0.6 * _unit(carried)
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
                f"masks samples whose advantage is a robust outlier (z above {threshold}) within its group or batch",
            ),
            Experiment(
                f"drop_samples={_pairs(pairs)}",
                "leaves these samples out: if the spike goes, they are the cause (diagnostic, not a production method)",
                True,
            ),
            Experiment(
                f"advantage_clip={max(1.0, round(max(others, default=1.0), 2)):g}",
                "clamps every advantage to the healthy samples' range",
            ),
        ],
    )


def negative_dominance(ev: Evidence) -> Cause | None:
    s = ev.analysis.sign_balance
    if not s:
        return None
    ratio = s["negative_to_positive"]
    if ratio is None or math.isnan(ratio) or ratio < 1.5:  # the totals are of finite advantages (analyze)
        return None
    outliers = _outlier_pairs(ev.analysis)
    if outliers:  # a few outlier samples can tip the balance alone: judge the rest of the batch
        rest = [
            r
            for r in ev.analysis.samples["rows"]
            if (r["rank"], r["sample"]) not in outliers and _finite(r["advantage"])
        ]
        pos = math.fsum(max(0.0, r["advantage"]) * r["loss_tokens"] for r in rest)
        neg = math.fsum(max(0.0, -r["advantage"]) * r["loss_tokens"] for r in rest)
        ratio = neg / pos if pos else (math.inf if neg else 0.0)
        if ratio < 1.5:
            return None
    strength = 1.0 if math.isinf(ratio) else _unit((ratio - 1.0) / 4.0)
    neg_tokens = s["negative_tokens"] / max(1, s["negative_tokens"] + s["positive_tokens"] + s["zero_tokens"])
    skipped = s.get("non_finite_tokens") or 0
    evidence = [
        f"negative advantages outweigh positive ones {'entirely' if math.isinf(ratio) else f'{ratio:.3g}x'} "
        f"(totals per loss token {s['negative_total']:.4g} vs {s['positive_total']:.4g}); "
        f"{_pct(neg_tokens)} of loss tokens have a negative advantage"
        + (f" ({skipped} non-finite left out)" if skipped else "")
    ]
    if ev.attribution is not None:
        neg = math.fsum(x.share for x in ev.attribution.samples if x.advantage < 0 and _finite(x.share))
        evidence.append(
            f"negative-advantage samples among the top {len(ev.attribution.samples)} carry {_pct(neg)} of ‖g‖"
        )
    return Cause(
        "negative_advantage_dominance",
        "negative-advantage dominance",
        strength,
        evidence,
        {"negative_to_positive": ratio, "negative_token_fraction": neg_tokens},
        [
            Experiment("balance_negative_advantages=true", "scales negative advantages to the positives' total"),
            Experiment("advantage_clip=1", "clamps advantages to [-1, 1]"),
            Experiment("dual_clip_c=3", "caps the loss of negative-advantage tokens with large ratios"),
        ],
    )


def routing_mismatch(ev: Evidence) -> Cause | None:
    if ev.routes is None or not ev.routes.layers:
        return None
    layers = [x for x in ev.routes.layers if _finite(x.loss_disagreement)]
    if not layers:
        return None
    worst = max(layers, key=lambda x: x.loss_disagreement or 0.0)
    d = worst.loss_disagreement or 0.0
    rest = [x.loss_disagreement or 0.0 for x in layers if x is not worst]
    typical = statistics.median(rest) if rest else 0.0
    if d < 0.1 or (rest and d < 3 * typical):
        return None
    per_layer = "; ".join(
        f"layer {x.layer}: {_pct(x.loss_disagreement or 0.0)} of loss tokens, "
        + (f"{_pct(x.other_disagreement)} of non-loss tokens" if x.other_disagreement is not None else "no non-loss")
        for x in layers
    )
    evidence = [
        f"the model's own routing differs from the recorded routes in layer {worst.layer} on "
        f"{_pct(d)} of loss tokens (median of the other layers {_pct(typical)})",
        f"route disagreement per MoE layer: {per_layer}",
        f"routing replay in the run: {ev.routes.routing_replay}",
    ]
    return Cause(
        "routing_mismatch",
        "routing mismatch (recorded routes vs the trainer's router)",
        _unit(d / 0.3),
        evidence,
        {"layer": worst.layer, "loss_disagreement": d, "median_other_layers": typical},
        [
            Experiment(
                f"current_routing_layers={worst.layer}",
                f"routes layer {worst.layer} on current scores, replaying the recorded routes elsewhere",
            ),
            Experiment("routing_replay=loss_tokens", "replays recorded routes only where the loss is taken"),
            Experiment("routing_replay=off", "if the spike grows, routing replay was helping; never a fix", True),
        ],
    )


def one_rank(ev: Evidence) -> Cause | None:
    if ev.world_size < 2:
        return None
    shares: dict[int, float] = {}
    if ev.attribution is not None:
        for s in ev.attribution.samples:
            if _finite(s.share):
                shares[s.rank] = shares.get(s.rank, 0.0) + s.share
    local = {k.rank: k.local_grad_norm for k in ev.grads.ranks} if ev.grads is not None else {}
    finite = {r: v for r, v in local.items() if math.isfinite(v)}
    evidence, strength, rank = [], 0.0, None
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
            evidence.append(f"rank {top_rank}'s top samples carry {_pct(shares[top_rank])} of ‖g‖")
    if rank is None or not evidence:
        return None
    samples = [(s.rank, s.sample) for s in _carriers(ev.attribution, 0.8) if s.rank == rank]
    experiments = []
    if samples:
        experiments.append(
            Experiment(
                f"drop_samples={_pairs(samples)}",
                f"leaves out rank {rank}'s top samples: whether the spike is that rank's data",
                True,
            )
        )
    return Cause("one_rank", f"one rank's data (rank {rank})", strength, evidence, {"rank": rank}, experiments)


FAMILIES = (non_finite, logprob_mismatch, outlier_advantage, negative_dominance, routing_mismatch, one_rank)
