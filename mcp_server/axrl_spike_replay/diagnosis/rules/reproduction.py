"""A step that does not reproduce is a finding, and the per-rank comparison explains it.

Each rank's recorded loss and per-parameter grad norms (before the data-parallel mean) are set against the ones the
replay computes from the snapshot's weights and that rank's stored batch (`LossChannel.rank_param_norms`), and
reduced to what a person can act on:

- which ranks match (loss and every parameter within `MATCH_TOLERANCE`) and which differ;
- per differing rank, the ratio recorded / replayed of each parameter's norm: one factor everywhere (spread at most
  `ONE_FACTOR`) is a loss or gradient scale outside the recorded config, with the factor; a factor per decoder layer
  or per parameter family (`models.param_groups`) names those layers or that family; no pattern: the rank's recorded
  gradient is not that of its stored batch (the batch it stored is not the one it trained on, or the weights or
  recorded norms were edited);
- the rank's loss ratio says where the scale sits: the loss itself scaled (the recorded loss carries the factor), or
  the gradients after the loss (the recorded loss matches);
- the prediction: the replay's own per-rank gradients, each scaled as the finding says, give a reduced norm
  (exactly, from the per-parameter dots `LossChannel.param_gram`); it should be the recorded global norm. A rank
  with no pattern has no scale to apply: its recorded local norm bounds its part (triangle inequality).

The cause (`step_not_reproduced`) is scoped to the differing ranks, and heads the diagnosis whenever the step does
not reproduce: a replay judges mitigations against a step it recomputes, so until the recorded one is explained no
other reading of the spike is the recorded step's. Replays cannot undo a trainer-side scale (the replay computes the
loss the recorded config defines), so the experiments are those that test it: the hypothesis replay of a scaled
loss (`loss_scale=F@R`), and the trainer-side checks the pattern points at.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.diagnosis.rules.causes import Cause, Experiment
from axrl_spike_replay.experiment.step_evidence import LossChannel
from axrl_spike_replay.models.param_groups import family_of, layer_of
from axrl_spike_replay.snapshot.consistency import LOSS_ABS_TOLERANCE, LOSS_TOLERANCE
from axrl_spike_replay.snapshot.replayed_param_norms import plain_name

MATCH_TOLERANCE = 1e-4  # relative, per parameter (plus that share of the rank's norm): the same fp32 arithmetic
ONE_FACTOR = 0.01  # a rank's ratios within 1 % of one factor: one scale
CARRY = 1e-4  # parameters whose replayed norm is below this share of the rank's own carry no ratio
REPRODUCES = 1e-4  # relative: the replayed global norm within this of the recorded one reproduces the step
PREDICTS = 1e-4  # relative: a prediction within this of the recorded global norm holds
STRONG, WITNESSED, UNEXPLAINED, GLOBAL_ONLY = 1.0, 0.9, 0.8, 0.5


@dataclass
class RankReading:
    """One rank's recorded figures against the replay's."""

    rank: int
    matches: bool
    pattern: str  # match | one_factor | by_layer | by_family | loss_only | none
    factor: float | None = None  # the median ratio recorded / replayed over the parameters carrying norm
    spread: float = 0.0  # the largest |ratio / factor - 1| over them
    compared: int = 0
    loss_recorded: float | None = None
    loss_replayed: float | None = None
    groups: dict[str, float] = field(default_factory=dict)  # group -> factor (by_layer / by_family)
    scale: dict[str, float] = field(default_factory=dict)  # parameter -> the finding's factor (empty: none)
    local_norm: float = 0.0  # the rank's recorded local norm (sqrt of the sum of its squared per-parameter norms)
    non_finite: int = 0  # parameters whose recorded norm is not finite where the replay's is (not compared)

    @property
    def loss_ratio(self) -> float | None:
        if self.loss_recorded is None or self.loss_replayed is None or not self.loss_replayed:
            return None
        return self.loss_recorded / self.loss_replayed

    @property
    def loss_matches(self) -> bool | None:
        if self.loss_recorded is None or self.loss_replayed is None:
            return None
        return math.isclose(self.loss_recorded, self.loss_replayed, rel_tol=LOSS_TOLERANCE, abs_tol=LOSS_ABS_TOLERANCE)

    @property
    def loss_scaled(self) -> bool:
        """The rank's recorded loss carries its gradients' factor (the loss itself was scaled)."""
        ratio = self.loss_ratio
        return self.factor is not None and ratio is not None and abs(ratio / self.factor - 1.0) <= ONE_FACTOR


@dataclass
class Prediction:
    """The recorded global norm predicted from the replay's per-rank gradients under the finding."""

    predicted: float | None  # exact (every rank explained); None: bounds only
    low: float
    high: float
    recorded: float

    @property
    def holds(self) -> bool:
        if self.predicted is not None:
            return abs(self.predicted - self.recorded) <= PREDICTS * abs(self.recorded)
        return self.low * (1 - PREDICTS) <= self.recorded <= self.high * (1 + PREDICTS)


def read_rank(
    rank: int, recorded: dict[str, float], replayed: dict[str, float], loss: tuple[float | None, float | None]
) -> RankReading:
    """Rank `rank`'s recorded per-parameter norms (and loss) against the replay's: its pattern (module doc)."""
    rec = {plain_name(k): float(v) for k, v in recorded.items()}
    rep = {plain_name(k): float(v) for k, v in replayed.items()}
    names = [n for n in rec if n in rep and math.isfinite(rec[n]) and math.isfinite(rep[n])]
    scale = math.sqrt(math.fsum(rep[n] ** 2 for n in names))
    local = math.sqrt(math.fsum(rec[n] ** 2 for n in names))
    out = RankReading(rank, True, "match", compared=len(names), loss_recorded=loss[0], loss_replayed=loss[1])
    out.local_norm = local
    slack = [MATCH_TOLERANCE * (max(abs(rec[n]), abs(rep[n])) + scale) for n in names]
    norms_match = all(abs(rec[n] - rep[n]) <= s for n, s in zip(names, slack, strict=True))
    # a recorded norm that is not finite (NaN, or a gradient past the float range) where the replay's is: differs
    overflowed = [n for n in rec if n in rep and not math.isfinite(rec[n]) and math.isfinite(rep[n])]
    if norms_match and not overflowed and out.loss_matches is not False:
        return out
    out.matches = False
    if overflowed:
        out.pattern, out.non_finite = "none", len(overflowed)  # no ratio to read there: no scale explains them
        out.local_norm = math.inf  # the rank's part is unbounded: its recorded norms past the float range bound nothing
        return out
    carrying = [n for n in names if rep[n] > CARRY * scale]
    ratios = {n: rec[n] / rep[n] for n in carrying}
    if not ratios:
        out.pattern = "none"
        return out
    out.factor = statistics.median(ratios.values())
    out.spread = max(abs(r / out.factor - 1.0) for r in ratios.values()) if out.factor else math.inf
    if norms_match:
        out.pattern, out.factor, out.spread = "loss_only", 1.0, 0.0
        out.scale = dict.fromkeys(names, 1.0)
        return out
    if out.spread <= ONE_FACTOR:
        out.pattern = "one_factor"
        out.scale = dict.fromkeys(names, out.factor)
        return out
    for pattern, key in (("by_layer", _layer_key), ("by_family", family_of)):
        groups = _groups(ratios, key)
        if groups is not None and len({round(f, 3) for f in groups.values()}) > 1:
            out.pattern, out.groups = pattern, groups
            out.scale = {n: groups.get(key(n), 1.0) for n in names}
            return out
    out.pattern = "none"
    return out


def _layer_key(name: str) -> str:
    layer = layer_of(name)
    return "outside the layers" if layer is None else f"layer {layer}"


def _groups(ratios: dict[str, float], key: Any) -> dict[str, float] | None:
    """Each group's factor when every group's ratios are within ONE_FACTOR of it (None: some group is not)."""
    by: dict[str, list[float]] = {}
    for name, ratio in ratios.items():
        by.setdefault(key(name), []).append(ratio)
    out = {}
    for group, values in by.items():
        factor = statistics.median(values)
        if not factor or max(abs(v / factor - 1.0) for v in values) > ONE_FACTOR:
            return None
        out[group] = factor
    return out


def predict(readings: list[RankReading], channel: LossChannel, recorded: float, world: int) -> Prediction | None:
    """The recorded global norm from the replay's per-rank gradients scaled as `readings` say (None: no dots)."""
    gram = channel.param_gram
    if not gram or not gram.get("params"):
        return None
    order = [int(r) for r in gram["ranks"]]
    by_rank = {r.rank: r for r in readings}
    known = [i for i, r in enumerate(order) if r in by_rank and (by_rank[r].matches or by_rank[r].scale)]
    odd = [r for r in order if r in by_rank and not by_rank[r].matches and not by_rank[r].scale]
    total = 0.0
    for name, matrix in gram["params"].items():
        s = [by_rank[order[i]].scale.get(plain_name(name), 1.0) if order[i] in by_rank else 1.0 for i in known]
        total += math.fsum(s[a] * s[b] * matrix[i][j] for a, i in enumerate(known) for b, j in enumerate(known))
    part = math.sqrt(max(total, 0.0)) / world
    if not odd:
        return Prediction(part, part, part, recorded)
    rest = math.fsum(by_rank[r].local_norm for r in odd) / world
    return Prediction(None, max(0.0, part - rest), part + rest, recorded)


def reproduction_cause(
    readings: list[RankReading],
    recorded_norm: float,
    replayed_norm: float | None,
    prediction: Prediction | None,
) -> Cause | None:
    """The `step_not_reproduced` cause (module doc), None when the step reproduces and every rank matches."""
    if replayed_norm is None or not math.isfinite(recorded_norm) or not math.isfinite(replayed_norm):
        return None
    rel = abs(replayed_norm - recorded_norm) / abs(recorded_norm) if recorded_norm else math.inf
    reproduces = rel <= REPRODUCES
    differ = [r for r in readings if not r.matches]
    if reproduces and not differ:
        return None
    match = [r.rank for r in readings if r.matches]
    evidence = [
        f"the step does not reproduce: the replay gives grad norm {replayed_norm:.6g} from the snapshot's weights and "
        f"batches, the recorded one is {recorded_norm:.6g} (ratio {recorded_norm / replayed_norm:.4g})"
        if not reproduces
        else f"the global grad norm reproduces ({replayed_norm:.6g} against {recorded_norm:.6g}), yet some ranks' "
        "recorded figures are not what the replay gives them",
    ]
    if readings:
        evidence.append(
            f"per rank, recorded loss and per-parameter norms (before the mean) against the replay's: ranks "
            f"{_ranks(match) or 'none'} match; ranks {_ranks([r.rank for r in differ]) or 'none'} differ"
        )
    else:
        evidence.append("no per-rank comparison (the grad info records no local per-parameter norms)")
    for r in differ:
        evidence.append(_rank_sentence(r))
    if prediction is not None:
        evidence.append(_prediction_sentence(prediction, differ))
    explained = bool(differ) and all(r.scale for r in differ)
    if not reproduces:
        strength = STRONG if explained and prediction is not None and prediction.holds else WITNESSED
        if not differ or not readings:
            strength = UNEXPLAINED
    else:
        strength = GLOBAL_ONLY
    evidence += _explanations(differ)
    title = _title(differ, reproduces)
    figures: dict[str, Any] = {
        "recorded_grad_norm": recorded_norm,
        "replayed_grad_norm": replayed_norm,
        "reproduces": reproduces,
        "matching_ranks": match,
        "ranks": {
            str(r.rank): {
                "pattern": r.pattern,
                "factor": r.factor,
                "spread": r.spread,
                "groups": r.groups,
                "loss_recorded": r.loss_recorded,
                "loss_replayed": r.loss_replayed,
                "parameters": r.compared,
            }
            for r in differ
        },
    }
    if prediction is not None:
        figures |= {
            "predicted_grad_norm": prediction.predicted,
            "predicted_bounds": [prediction.low, prediction.high],
            "prediction_holds": prediction.holds,
        }
    return Cause(
        "step_not_reproduced",
        title,
        strength,
        evidence,
        figures,
        _experiments(differ),
        ranks=sorted(r.rank for r in differ) if len(differ) < len(readings) else [],
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _rank_sentence(r: RankReading) -> str:
    loss = ""
    if r.loss_recorded is not None and r.loss_replayed is not None:
        ratio = r.loss_ratio
        loss = f"; loss recorded {r.loss_recorded:.6g}, replayed {r.loss_replayed:.6g}" + (
            f" (ratio {ratio:.6g})" if ratio is not None else ""
        )
    head = f"rank {r.rank}: recorded / replayed norm over {r.compared} parameters"
    if r.pattern in ("one_factor", "loss_only"):
        return f"{head}: one factor {r.factor:.6g} everywhere (spread {r.spread:.2g}){loss}"
    if r.pattern in ("by_layer", "by_family"):
        groups = ", ".join(f"{g} x{f:.6g}" for g, f in sorted(r.groups.items()))
        return f"{head}: a factor per {r.pattern[3:]} ({groups}), median {r.factor:.4g}{loss}"
    median = f"median {r.factor:.4g}, spread {r.spread:.3g}" if r.factor is not None else "no parameter carries norm"
    if r.non_finite:
        median += f"; {r.non_finite} recorded norms are not finite where the replay's are"
    return f"{head}: no single factor nor one per layer or parameter family ({median}){loss}"


def _prediction_sentence(p: Prediction, differ: list[RankReading]) -> str:
    how = "the replay's per-rank gradients" + (
        " with " + "; ".join(_scaled(r) for r in differ if r.scale) if any(r.scale for r in differ) else ""
    )
    if p.predicted is not None:
        rel = abs(p.predicted - p.recorded) / abs(p.recorded) if p.recorded else math.inf
        verdict = "predict" if p.holds else "do not predict"
        return (
            f"prediction: {how} {verdict} the recorded grad norm: {p.predicted:.7g} against {p.recorded:.7g} "
            f"recorded (rel diff {rel:.2g})"
        )
    odd = _ranks([r.rank for r in differ if not r.scale])
    if not math.isfinite(p.high):
        overflowed = _ranks([r.rank for r in differ if r.non_finite])
        above = "lies above it" if p.holds else "lies below it"
        return (
            f"prediction: rank {overflowed}'s recorded per-parameter norms are not finite where the replay's are (its "
            f"gradient past the float range of the norms it recorded): its part of the step is unbounded, so "
            f"{how} bound the recorded grad norm from below only, at {p.low:.6g}; the recorded {p.recorded:.6g} {above}"
        )
    inside = "lies within" if p.holds else "lies outside"
    return (
        f"prediction: {how}, and rank {odd}'s recorded local norm as a bound on its part, put the recorded grad norm "
        f"in [{p.low:.6g}, {p.high:.6g}]; the recorded {p.recorded:.6g} {inside} them"
    )


def _scaled(r: RankReading) -> str:
    if r.pattern in ("by_layer", "by_family"):
        scaled = ", ".join(f"{g} x{f:.6g}" for g, f in sorted(r.groups.items()) if abs(f - 1.0) > ONE_FACTOR)
        return f"rank {r.rank}'s {scaled}"
    return f"rank {r.rank}'s gradient x{r.factor:.6g}"


def _title(differ: list[RankReading], reproduces: bool) -> str:
    if not differ:
        return "the step does not reproduce, though every rank's recorded loss and norms match the replay"
    parts = []
    for r in differ:
        if r.pattern == "one_factor" and r.loss_scaled:
            parts.append(f"rank {r.rank}'s loss and gradients are x{r.factor:.4g} the recorded config's (a loss scale)")
        elif r.pattern == "one_factor":
            parts.append(f"rank {r.rank}'s gradients are x{r.factor:.4g} its loss's (a gradient scale)")
        elif r.pattern in ("by_layer", "by_family"):
            parts.append(f"{_scaled(r)} (a scale by {r.pattern[3:]})")
        elif r.pattern == "loss_only":
            parts.append(f"rank {r.rank}'s recorded loss is not its batch's, its gradients are")
        else:
            parts.append(f"rank {r.rank}'s recorded gradient is not that of its stored batch")
    head = "the step does not reproduce" if not reproduces else "some ranks' records are not the replay's"
    return f"{head}: " + "; ".join(parts)


def _explanations(differ: list[RankReading]) -> list[str]:
    out = []
    patterns = {r.pattern for r in differ}
    if any(r.pattern == "one_factor" and r.loss_scaled for r in differ):
        out.append(
            "a loss scale outside the recorded config (the recorded loss carries the factor): micro-batch losses "
            "summed where they are averaged, a normalisation by another token count, a loss scale never removed, a "
            "loss setting that reached this rank only; the hypothesis replay `loss_scale=F@RANK` tests it"
        )
    if any(r.pattern == "one_factor" and not r.loss_scaled for r in differ):
        out.append(
            "a gradient scale after the loss (the recorded loss is the batch's): gradient accumulation without "
            "dividing by the micro-batch count, a loss scaler's unscale skipped, a gradient hook; a replay cannot "
            "undo a trainer-side scale of the gradients (it computes the loss's own), so the prediction above is the "
            "test, and the trainer's accumulation, loss scaler and hooks on that rank are what to check"
        )
    if "by_layer" in patterns:
        out.append(
            "a scale on some layers only: a gradient hook registered twice on those modules, an unscale skipped for "
            "one parameter group; check that rank's hooks and parameter groups (no replay setting expresses it)"
        )
    if "by_family" in patterns:
        out.append(
            "a scale on one parameter family: its gradients reduced with SUM where the others are averaged (an "
            "expert-parallel or sequence-parallel all-reduce), a family-specific scale; check that reduction"
        )
    if any(r.pattern == "none" and r.loss_matches is False for r in differ):
        out.append(
            "the rank's loss differs too: a loss setting other than the recorded config on that rank (a coefficient, "
            "a normalisation); the hypothesis replays `NAME=VALUE@RANK` diagnose lists test each"
        )
    if any(r.pattern == "none" and r.loss_matches for r in differ):
        out.append(
            "the rank's forward reproduces (its recorded loss is the replay's) while its gradient does not: what "
            "differs comes after the loss, in that rank's backward or its gradients (a gradient that reaches other "
            "weights than the forward used; a hook, a clip or a reduction on that rank's gradients only); check that "
            "rank's backward against the model's"
        )
    if "none" in patterns:
        out.append(
            "no scale explains it; several readings fit: the trainer computed that rank's step differently from the "
            "model the run config describes (a fused kernel, a module or a setting other than the config's), the "
            "batch that rank stored is not the one it trained on (a stale buffer, another micro-batch, advantages "
            "changed after the copy), or the weights or the recorded norms were edited; compare that "
            "rank's training forward and the batch the snapshot writer stores with the ones the loss consumed"
        )
    if "loss_only" in patterns:
        out.append("the recorded loss differs while the gradients match: a constant in the logged loss, or the log")
    return out


def _experiments(differ: list[RankReading]) -> list[Experiment]:
    out = []
    for r in differ:
        if r.pattern == "one_factor" and r.loss_scaled and r.factor and r.factor > 0:
            out.append(
                Experiment(
                    f"loss_scale={r.factor:.6g}@{r.rank}",
                    f"rank {r.rank}'s loss scaled by {r.factor:.6g}: the step should then reproduce (grad norm and "
                    "every rank's loss)",
                    diagnostic_only=True,
                    refutes="the grad norm or a rank's loss is not the recorded one",
                )
            )
        elif r.pattern == "none":
            out.append(
                Experiment(
                    f"drop_ranks={r.rank}",
                    f"the step without rank {r.rank}'s stored batch (the one its record does not match): how much of "
                    "the spike the other ranks carry",
                    diagnostic_only=True,
                    refutes="the spike stays within 20 % of the baseline",
                )
            )
    return out


@dataclass
class Reproduction:
    """What the rule reads: every rank's reading, the prediction, the replay's global norm."""

    readings: list[RankReading]
    prediction: Prediction | None
    replayed_norm: float | None


def compare_ranks(infos: dict[int, dict[str, Any]], channel: LossChannel, recorded_norm: float) -> Reproduction:
    """Each rank's grad info (`infos`: {rank: load_grad_info}) against the replay's loss channel. Ranks whose grad
    info records no local norms (`param_grad_norms_kind` reduced or reduced_shard: no rank's own gradient) are left
    out: nothing of theirs can be compared rank by rank."""
    readings = []
    world = len(infos)
    for rank, info in sorted(infos.items()):
        replayed = channel.param_norms_of(rank)
        if replayed is None or info.get("param_grad_norms_kind") is not None or not info.get("param_grad_norms"):
            continue
        loss = (info.get("loss"), channel.rank_loss(rank))
        readings.append(read_rank(rank, info["param_grad_norms"], replayed, loss))
    prediction = predict(readings, channel, recorded_norm, world) if readings and world else None
    return Reproduction(readings, prediction, channel.grad_norm)


def step_not_reproduced(ev: Any) -> Cause | None:
    """The rule: the step's reproduction read from the per-rank comparison (`Evidence.reproduction`)."""
    found: Reproduction | None = getattr(ev, "reproduction", None)
    if found is None:
        return None
    return reproduction_cause(found.readings, ev.analysis.grad_norm, found.replayed_norm, found.prediction)
