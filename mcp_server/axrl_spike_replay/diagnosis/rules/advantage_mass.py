"""Where the negative advantages' mass sits: spread over many samples, or concentrated in a few of extreme magnitude.

Negative advantages can outweigh the positive ones two ways. Many samples below 0, each of an ordinary size, is the
sign balance itself (`negative_advantage_dominance`). A few samples whose |advantage| stands far beyond every other
sample's (a reward on another scale, a penalty applied per token instead of per thousand) tip the totals by their
magnitude alone: those samples are the broken part (`outlier_advantage`), and the sign balance is their symptom.

`concentrated_negatives` splits the samples at the widest gap of their sorted |advantage|: the samples above it are
extreme where they are at most half of the batch, their smallest |advantage| is `SCALE` times the rest's median and
`OUTLIER_Z` robust deviations (median absolute deviation) beyond it, and they carry `MASS` of the negative total.
They are a few (`FEW` of the batch at most), or their rewards are extreme too: outside the other samples' reward
range by at least its width (the magnitude came in with the rewards). Many samples of ordinary rewards whose
advantages are all offset far below 0 (a baseline on another scale on one rank) stay the sign balance.

`weigh_concentration` then judges the sign reading on the rest alone, under 0.8 (`SYMPTOM`, or as the rest's balance
says up to `REST_MOST`), saying why, and lets the outlier reading of those samples lead (`LEADS`), made from them
where no other rule read them. Where the rewards of those ranks follow their responses' lengths (|Pearson r| ≥
`LENGTH_R`), the evidence says so: a length-shaped reward."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from axrl_spike_replay.diagnosis.rules.causes import (
    FEW,
    OUTLIER_Z,
    Cause,
    Evidence,
    Experiment,
    is_finite,
    percent_text,
    sample_pairs,
    unit_strength,
)

SCALE = 10.0  # the extreme samples' smallest |advantage| at least this many times the rest's median
MASS = 0.9  # ... and they carry at least this share of the negative advantages' total
SYMPTOM = 0.5  # the sign reading's strength where the mass is concentrated and the rest does not dominate
REST_MOST = 0.7  # the most it keeps where the rest's negatives still dominate (judged on the rest alone)
LEADS = 0.9  # the outlier reading's strength there
LENGTH_R = 0.8  # |Pearson r| of rewards against response lengths that reads as a length-shaped reward
DOMINATES = 1.5  # the sign ratio negative_advantage_dominance reads as dominance
MAD_SCALE = 1.4826  # a median absolute deviation as a normal distribution's std


@dataclass
class Concentration:
    """The few samples whose negative advantages carry the sign balance: `samples` (rank, sample), `share` of the
    negative total they carry, their smallest |advantage| `low`, the rest's median |advantage| `rest`, the robust z
    of `low` over the rest, the sign ratio of the rest, and per rank the rewards' correlation with response length."""

    samples: list[tuple[int, int]]
    share: float
    low: float
    rest: float
    z: float
    rest_ratio: float
    rows: int
    length_r: dict[int, float]
    reward_gap: float | None  # how far outside the others' reward range their rewards lie (None: not read)

    @property
    def ranks(self) -> list[int]:
        return sorted({r for r, _ in self.samples})

    def sentence(self) -> str:
        return (
            f"{len(self.samples)} of {self.rows} samples ({sample_pairs(self.samples)}) carry "
            f"{percent_text(self.share)} of the negative advantages' total, each |advantage| at least {self.low:.4g}: "
            f"{self.low / self.rest if self.rest > 0 else math.inf:.3g}x the other samples' median {self.rest:.3g} "
            f"(robust z {self.z:.3g}); without them the negatives weigh {self.rest_ratio:.3g}x the positives"
            + (
                ""
                if self.reward_gap is None
                else f"; their rewards lie {self.reward_gap:.4g} outside the other samples' reward range"
            )
        )


def _rows(ev: Evidence) -> list[dict[str, Any]]:
    return [r for r in ev.analysis.samples["rows"] if r["loss_tokens"] and is_finite(r["advantage"])]


def _sign_ratio(rows: list[dict[str, Any]]) -> float:
    pos = math.fsum(max(0.0, r["advantage"]) * r["loss_tokens"] for r in rows)
    neg = math.fsum(max(0.0, -r["advantage"]) * r["loss_tokens"] for r in rows)
    return neg / pos if pos else (math.inf if neg else 0.0)


def _pearson(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def length_correlation(rows: list[dict[str, Any]], ranks: list[int]) -> dict[int, float]:
    """{rank: Pearson r of its samples' rewards against their loss-token counts} where both vary."""
    out: dict[int, float] = {}
    for rank in ranks:
        mine = [r for r in rows if r["rank"] == rank and is_finite(r.get("reward"))]
        r = _pearson([float(x["loss_tokens"]) for x in mine], [float(x["reward"]) for x in mine])
        if r is not None and math.isfinite(r):
            out[rank] = r
    return out


def reward_gap(top: list[dict[str, Any]], rest: list[dict[str, Any]]) -> float | None:
    """How far the rewards of `top` lie outside the range of `rest`'s rewards (the nearest of them), where that is at
    least the range's width (and above 0); None otherwise or without finite rewards on both sides."""
    theirs = [r["reward"] for r in top if is_finite(r.get("reward"))]
    others = [r["reward"] for r in rest if is_finite(r.get("reward"))]
    if len(theirs) < len(top) or not others:
        return None
    lo, hi = min(others), max(others)
    gap = min(max(lo - v, v - hi) for v in theirs)
    return gap if gap > 0 and gap >= hi - lo else None


def concentrated_negatives(ev: Evidence) -> Concentration | None:
    """The few samples of extreme magnitude that carry the negative advantages' total (module doc); None where the
    negative mass is spread (or nothing dominates)."""
    rows = _rows(ev)
    if len(rows) < 4 or _sign_ratio(rows) < DOMINATES:
        return None
    order = sorted(range(len(rows)), key=lambda i: -abs(rows[i]["advantage"]))
    mags = [abs(rows[i]["advantage"]) for i in order]
    # the widest gap (as a ratio) between neighbours, the extreme side at most half of the batch
    gaps = [(mags[k - 1] / mags[k] if mags[k] > 0 else math.inf, k) for k in range(1, len(rows) // 2 + 1)]
    _, cut = max(gaps)
    top, rest = [rows[i] for i in order[:cut]], [rows[i] for i in order[cut:]]
    rest_mags = mags[cut:]
    median = statistics.median(rest_mags)
    mad = MAD_SCALE * statistics.median(abs(m - median) for m in rest_mags)
    low = mags[cut - 1]
    z = (low - median) / mad if mad > 0 else math.inf
    if not (median > 0 and low >= SCALE * median and z >= OUTLIER_Z):
        return None
    negative = math.fsum(-r["advantage"] * r["loss_tokens"] for r in rows if r["advantage"] < 0)
    theirs = math.fsum(-r["advantage"] * r["loss_tokens"] for r in top if r["advantage"] < 0)
    share = theirs / negative if negative > 0 else 0.0
    rest_ratio = _sign_ratio(rest)
    if share < MASS:
        return None
    gap = reward_gap(top, rest)
    if len(top) > max(1, int(FEW * len(rows))) and gap is None:
        return None  # many samples of ordinary rewards, offset together: the sign balance's own reading
    pairs = sorted((r["rank"], r["sample"]) for r in top)
    ranks = sorted({r for r, _ in pairs})
    everything = ev.analysis.samples["rows"]
    lengths = length_correlation(everything, ranks)
    return Concentration(pairs, share, low, median, z, rest_ratio, len(rows), lengths, gap)


def _whole_ranks(ev: Evidence, c: Concentration) -> bool:
    """Whether the extreme samples are every trained sample of their ranks."""
    held = {(r["rank"], r["sample"]) for r in _rows(ev) if r["rank"] in c.ranks}
    return held == set(c.samples)


def _outlier_cause(ev: Evidence, c: Concentration) -> Cause:
    where = ",".join(str(r) for r in c.ranks)
    whole = _whole_ranks(ev, c)
    healthy = [abs(r["advantage"]) for r in _rows(ev) if (r["rank"], r["sample"]) not in set(c.samples)]
    clip = max(1.0, round(max(healthy, default=1.0), 2))
    drop = (
        Experiment(
            f"drop_ranks={where}",
            f"leaves rank {where}'s samples out: if the spike goes, their advantages carry it",
            True,
            refutes="the spike stays within 20 % of the baseline",
        )
        if whole
        else Experiment(
            f"drop_samples={sample_pairs(c.samples)}",
            "leaves these samples out: if the spike goes, they are the cause (diagnostic, not a production method)",
            True,
            refutes="the spike stays within 20 % of the baseline",
        )
    )
    return Cause(
        "outlier_advantage",
        f"advantages of extreme magnitude on {'rank' if whole else 'a few samples of rank'} {where}",
        LEADS,
        [],
        {"samples": [list(p) for p in c.samples]},
        [
            Experiment(
                f"advantage_clip={clip:g}",
                f"clamps every advantage to the other samples' range (|A| at most {clip:g})",
                refutes="the spike stays within 20 % of the baseline",
            ),
            drop,
        ],
        ranks=c.ranks,
        samples=[] if whole else c.samples,
        term="policy",
    )


def weigh_concentration(found: list[Cause], ev: Evidence) -> list[Cause]:
    """`found` with the sign reading set under the outlier reading where the negative mass is concentrated in a few
    samples of extreme magnitude (module doc); unchanged where it is spread."""
    sign = next((c for c in found if c.family == "negative_advantage_dominance"), None)
    if sign is None:
        return found
    c = concentrated_negatives(ev)
    if c is None:
        return found
    said = c.sentence()
    lengths = [
        f"rank {rank}'s rewards follow its responses' lengths (Pearson r {r:.3g}): a reward shaped by length"
        for rank, r in sorted(c.length_r.items())
        if abs(r) >= LENGTH_R
    ]
    figures = {
        "samples": [list(p) for p in c.samples],
        "share_of_negative_total": c.share,
        "smallest_abs_advantage": c.low,
        "others_median_abs_advantage": c.rest,
        "robust_z": c.z,
        "others_negative_to_positive": c.rest_ratio,
        "reward_length_r": c.length_r,
        "reward_gap": c.reward_gap,
    }
    rest = unit_strength((c.rest_ratio - 1.0) / 4.0) if c.rest_ratio >= DOMINATES else 0.0
    sign.strength = min(sign.strength, max(SYMPTOM, min(rest, REST_MOST)))
    sign.evidence.append(
        f"{said}: the negative mass is concentrated in a few samples of extreme magnitude, not spread over many "
        "negative samples; their advantages are the cause (outlier_advantage), this balance their symptom"
    )
    sign.figures["concentrated"] = figures
    outlier = next((x for x in found if x.family == "outlier_advantage" and set(x.ranks) <= set(c.ranks)), None)
    if outlier is None:
        outlier = _outlier_cause(ev, c)
        found = [*found, outlier]
    outlier.strength = max(outlier.strength, LEADS)
    outlier.evidence = [
        f"{said}: these samples' magnitude carries the sign balance (negative_advantage_dominance is its symptom)",
        *lengths,
        *outlier.evidence,
    ]
    outlier.figures["concentrated"] = figures
    if not outlier.ranks:
        outlier.ranks = c.ranks
    return found
