"""`diagnose SNAPSHOT`: the likely causes of a spike, ranked, each with its evidence as numbers and the
experiments to run (ready `--mitigation NAME=VALUE` items, least invasive first), and, when a rank's recorded
loss is not what the replay gives it, the hypothesis replays that would prove what that rank computed.

Evidence read: the batch signals (`analyze`), the per-rank grad info (`grads`), the snapshot's consistency
checks, the job's log at the iteration (when its logs are known) and, from the model, per-sample
attribution, every stored signal against the replay per rank (`signal_reading` names the odd one out) and the
gradient by loss term per rank (the channel).

Every cause is held to the per-rank figures (`causes_by_rank`): scoped to the ranks they single out, or weakened with
the reason it cannot be scoped. Families that fit equally (strengths within TIE, both likely) are capped at TIED,
name each other in `tied_with` and the comparison that would separate them, which runs here when the model evidence
did (`tie_break`); a step that does not reproduce is explained first (`reproduction`); an experiment that would
not change the snapshot's own config (`is_base_logprobs=old` on a run whose base is already old) is never
suggested. Nothing likely: `natural_spike`, stronger when the model
evidence was checked and every stored signal agrees.

Attribution needs a replay of the step. `diagnose` takes one the caller already has (`attribution`: the
object, its JSON or an `attribution.json` path, e.g. from `attribute`); without one it runs it here on the
CPU when that is cheap (`model="auto"`: a torch-engine snapshot whose checkpoint is at most
diagnose_model.AUTO_MODEL_BYTES, a few seconds for the reference model), never on a large model
(`model="never"` skips it; `"always"` runs it whatever the size). What was left out is listed in `not_checked`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.diagnosis.evidence.model_evidence import RouteAgreement
from axrl_spike_replay.diagnosis.evidence.ratio_shape import RatioShape, read_ratio_shape
from axrl_spike_replay.diagnosis.evidence.signal_reading import SignalReading, read_signals
from axrl_spike_replay.diagnosis.rules import causes, causes_by_rank, reproduction, tie_break
from axrl_spike_replay.diagnosis.rules.advantage_mass import weigh_concentration
from axrl_spike_replay.diagnosis.rules.advantage_sign import join_by_sign
from axrl_spike_replay.diagnosis.rules.causes import Cause, Evidence, Experiment
from axrl_spike_replay.diagnosis.rules.input_causes import input_causes, merge_input_causes
from axrl_spike_replay.diagnosis.rules.overflow import symptom_of_overflow
from axrl_spike_replay.diagnosis.rules.signal_families import (
    data_causes,
    logprob_causes,
    reference_causes,
    routing_causes,
)
from axrl_spike_replay.diagnosis.rules.token_alignment import symptoms_of_alignment
from axrl_spike_replay.diagnosis.suggestions.convention_experiments import in_convention
from axrl_spike_replay.diagnosis.suggestions.hypotheses import loss_hypotheses, rank_mismatches
from axrl_spike_replay.diagnosis.suggestions.no_ops import no_op_reason, run_configs
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.request.request_parts import How
from axrl_spike_replay.experiment.result import Attribution
from axrl_spike_replay.experiment.step_evidence import StepEvidence
from axrl_spike_replay.experiment.verdict import tolerance
from axrl_spike_replay.snapshot.consistency import (
    Consistency,
    check_replayed_losses,
    check_replayed_norm,
    check_snapshot,
)
from axrl_spike_replay.snapshot.layout import rank_files
from axrl_spike_replay.snapshot.log_point import LogPoint, log_point
from axrl_spike_replay.snapshot.rank_data import recorded_rank_loss
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.vocabulary import Fidelity

MODEL_MODES = ("auto", "always", "never")
CHECKED = {
    "non_finite": "non-finite grad norms, logprobs and advantages",
    "engine_mismatch": "rollout log-probs against the replay (the old ones without the model), per rank",
    "stale_old_logprobs": "the stored old log-probs against the replay at the snapshot's weights, per rank",
    "bad_ref_logprobs": "the stored reference log-probs against the replay, per rank, and the KL term's share",
    "routing_payload": "recorded routes against the model's own routing, per rank and MoE layer, loss and other tokens",
    "mask_misalignment": "loss tokens that no stored signal covers (every stored log-prob a 0 fill), and where each "
    "rank's loss masks start and stop against the tokens the engine generated, per rank, and a rank's tokens moved by "
    "±1 and ±2 positions against its stored log-probs where they sit off the policy",
    "outlier_advantage": f"per-sample advantages against their rank's batch (robust z ≥ {causes.OUTLIER_Z:g}, a few), "
    "each rank's typical |advantage| against the other ranks', and each rank's advantages against its own rewards "
    "group by group under the recorded estimator (centred, in the rewards' order)",
    "negative_advantage_dominance": "the sign balance of advantages over loss tokens",
    "one_rank_data": "per-rank local grad norms, shares of the attributed norm and of each loss term",
    "step_not_reproduced": "each rank's recorded loss and per-parameter norms against the replay's, the factor per "
    "rank, layer and parameter family, and the recorded global norm predicted from them",
}
RULES = (
    causes.non_finite,
    logprob_causes.engine_mismatch,
    logprob_causes.stale_old_logprobs,
    reference_causes.bad_ref_logprobs,
    routing_causes.routing_payload,
    data_causes.mask_misalignment,
    data_causes.outlier_advantage,
    causes.negative_advantage_dominance,
    data_causes.one_rank_data,
    reproduction.step_not_reproduced,
)
TIE = 0.1  # likely causes whose strengths are this close fit equally
TIED = 0.7  # the most a tied cause keeps


@dataclass
class Diagnosis:
    """What `diagnose` reports: `causes` ranked (strongest first; `natural_spike` first when nothing is likely),
    `next_steps` the experiments of the likely causes in order, `checked` and `not_checked` what was looked at."""

    snapshot: str
    iteration: int
    grad_norm: float
    spike_ratio: float
    causes: list[Cause]
    next_steps: list[Experiment]
    checked: list[str]
    not_checked: list[str] = field(default_factory=list)
    consistency: Consistency | None = None
    log: LogPoint | None = None
    attribution_top: list[dict[str, Any]] = field(default_factory=list)  # rank, sample, share, advantage, log-ratio
    routes: RouteAgreement | None = None
    step: StepEvidence | None = None  # the per-rank signal check and the loss channel (model evidence)
    reading: SignalReading | None = None  # the odd stored signals, read off `step`
    record: str | None = None  # where the diagnosis was kept (a workspace's task file), or why not; None: not asked
    # when a rank's recorded loss is not what the replay gives: the hypothesis replays (loss settings scoped to that
    # rank, `diagnosis.hypotheses`) that would each make it come out as recorded; the one the step reproduces under
    # is the proof
    hypotheses: list[Experiment] = field(default_factory=list)

    @property
    def top(self) -> Cause:
        return self.causes[0]

    def mitigation_items(self) -> list[str]:
        """The next steps as `--mitigation` items."""
        return [e.mitigation for e in self.next_steps]


def _model_evidence(
    snapshot: Path, attribution: Any, model: str, top: int, not_checked: list[str], how: How
) -> tuple[Attribution | None, StepEvidence | None]:
    from axrl_spike_replay.diagnosis.evidence import model_evidence as dm

    att = dm.read_attribution(attribution) if attribution is not None else None
    if model == "never":
        not_checked.append("stored signals against the replay, route agreement, loss channel (model evidence off)")
        if att is None:
            not_checked.append("per-sample attribution (model evidence off; pass an attribution)")
        return att, None
    size = dm.model_bytes(snapshot)
    if model == "auto" and (size is None or size > dm.AUTO_MODEL_BYTES):
        why = "checkpoint unreadable" if size is None else f"checkpoint {size / 2**20:.0f} MiB is not cheap here"
        not_checked.append(f"stored signals against the replay, route agreement, loss channel ({why})")
        if att is None:
            not_checked.append(
                f"per-sample attribution ({why}; run `attribute`, MCP `attribute_spike`, and pass its attribution.json)"
            )
        return att, None
    step = None
    try:
        if att is None:
            att = dm.run_attribution(snapshot, top, how)
    except AxrlError as exc:  # a non-finite step has no shares: the signal check and loss channel still run
        not_checked.append(f"per-sample attribution ({exc})")
    try:
        step = dm.run_step_evidence(snapshot, how)
        if step.channel is None:
            not_checked.append("loss channel (not computed streamed: it takes a gradient per loss term)")
    except AxrlError as exc:  # a snapshot the torch engine cannot rebuild: the static evidence still stands
        not_checked.append(f"model evidence ({exc})")
    return att, step


def _ratio_shape(directory: Path, loss: LossConfig | None, not_checked: list[str]) -> RatioShape | None:
    """The stored old-vs-rollout ratios' shape, against the loss's clip range (the evidence for the newer
    objectives); None, said in `not_checked`, where the batches lack those log-probs."""
    low, high = (1.0 - loss.clip_eps_low, 1.0 + loss.clip_eps_high) if loss is not None else (0.8, 1.2)
    try:
        shape = read_ratio_shape(directory, low, high)
    except AxrlError as exc:
        not_checked.append(f"the stored ratios' shape for GSPO / CISPO ({exc})")
        return None
    if shape is None:
        not_checked.append("the stored ratios' shape for GSPO / CISPO (no old and rollout log-probs on every rank)")
    return shape


def _check_replayed_norm(consistency: Consistency, recorded: float, att: Attribution, not_checked: list[str]) -> None:
    """The attribution replayed the step: its grad norm against the recorded one is a consistency check."""
    if att.mitigations:
        why = "the attribution ran under mitigations: its norm is another gradient's"
        consistency.skip("grad_norm_vs_replay", why)
        not_checked.append(f"grad_norm_vs_replay ({why})")
        return
    # one process replays every saved rank, so its summation order differs from training's as a reduced replay's does
    tol = tolerance(Fidelity.REDUCED, att.device)
    check_replayed_norm(consistency, recorded, att.grad_norm, tol, f"the attribution's replay ({att.device})")
    why = "the attribution keeps only the global norm; `replay` compares the recorded per-parameter norms with its own"
    consistency.skip("param_grad_norms_vs_replay", why)
    not_checked.append(f"param_grad_norms_vs_replay ({why})")


def diagnose_snapshot(
    snapshot: str | Path,
    *,
    attribution: Attribution | dict[str, Any] | str | Path | None = None,
    logs: Sequence[str | Path] | None = None,
    model: str = "auto",
    top: int = 10,
    how: How | None = None,
) -> Diagnosis:
    """Rank the likely causes of the spike in `snapshot` with their evidence and the experiments to run.

    `attribution`: an existing attribution (object, JSON document or `attribution.json` path); `logs`: the
    job's log files (default: those of the job output dir the snapshot sits in); `model`: auto | always |
    never, whether to compute attribution and route agreement here (see the module doc); `how`, the request's `shard`
    (auto: when the whole model does not fit one process) and `nproc`: whether they run sharded with FSDP2 over several
    processes, or streamed (one decoder layer at a time; the loss channel is then not computed)."""
    from axrl_spike_replay.analysis.batch_signals import analyze_snapshot
    from axrl_spike_replay.analysis.grad_info import top_param_grads

    if model not in MODEL_MODES:
        raise ConfigError(f"`model` must be one of {', '.join(MODEL_MODES)}, got {model!r}", "model")
    if not isinstance(top, int) or top < 1:
        raise ConfigError(f"`top` must be an integer >= 1, got {top!r}", "top")
    directory = Path(os.path.abspath(snapshot))
    analysis = analyze_snapshot(directory, top=top)
    not_checked = [f"missing field: {m}" for m in analysis.missing]
    try:
        grads = top_param_grads(directory, top=3)
    except AxrlError as exc:
        grads = None
        not_checked.append(f"per-rank grad info ({exc})")
    point = log_point(directory, analysis.iteration, logs)
    if point.grad_norm is None:
        not_checked.append(f"training log ({point.note})")
    consistency = check_snapshot(directory, log_grad_norm=point.grad_norm, log_source=point.source, log_note=point.note)
    att, step = _model_evidence(directory, attribution, model, top, not_checked, how or How())
    if att is not None:
        _check_replayed_norm(consistency, analysis.grad_norm, att, not_checked)
    from axrl_spike_replay.diagnosis.evidence.model_evidence import routes_of

    routes = routes_of(step.signals) if step is not None else None
    reading = read_signals(step.signals) if step is not None else None
    loss, routing, moe_layers = run_configs(directory, not_checked)
    world = len(analysis.ranks)
    hypotheses = _hypotheses(directory, step, loss, world, consistency)
    compared = _compare_ranks(directory, step, analysis.grad_norm, consistency, not_checked)
    ev = Evidence(
        analysis=analysis,
        grads=grads,
        attribution=att,
        routes=routes,
        world_size=world,
        reading=reading,
        channel=step.channel if step is not None else None,
        loss=loss,
        routing=routing,
        reproduction=compared,
    )
    found = weigh_concentration([c for rule in RULES if (c := rule(ev)) is not None], ev)  # a few extreme samples
    found = join_by_sign(found, ev)  # one symptom, one cause
    found = merge_input_causes(found, input_causes(directory, world, not_checked))  # a corrupt input leads
    symptoms_of_alignment(found, ev)  # tokens off their stored fields: the inputs that read off are its symptoms
    shape = _ratio_shape(directory, loss, not_checked)
    for cause in found:
        cause.experiments = [
            e
            for e in in_convention(cause.experiments, loss, routing, shape)
            if no_op_reason(e.mitigation, loss, routing, moe_layers) is None
        ]
    causes_by_rank.hold_to_ranks(found, causes_by_rank.singled_out(ev, world))
    symptom_of_overflow(found, ev)  # a non-finite step from finite inputs: the input that overflows leads
    untied = {id(c): c.strength for c in found}
    mark_ties(found)
    pairs = tie_break.name_comparisons(found)
    if pairs and step is not None and model == "auto":  # the model evidence ran here: a replay of it is cheap
        not_checked += tie_break.run_comparisons(directory, pairs, untied)
    found.sort(key=lambda c: -c.strength)
    _routes_before_what_they_move(found)
    _not_reproduced_first(found)
    likely = [c for c in found if c.strength >= causes.LIKELY]
    checked = [f"{name}: {what}" for name, what in CHECKED.items()]
    checked.append(f"consistency: {', '.join(consistency.checked)}")
    if not likely:
        likely = [_natural(found, reading), *found]
    steps: list[Experiment] = []
    for cause in likely:
        if cause.strength < causes.LIKELY and cause.family != "natural_spike":
            continue
        steps += [e for e in cause.experiments if e.mitigation not in {s.mitigation for s in steps}]
    base = att.log_ratio_base if att else None  # what the samples' log-ratio is taken against
    top_rows = [
        {
            "rank": s.rank,
            "sample": s.sample,
            "share": s.share,
            "advantage": s.advantage,
            "max_abs_log_ratio_current_vs_base": s.max_abs_log_ratio_current_vs_base,
            "log_ratio_base": base,
        }
        for s in (att.samples[:5] if att else [])
    ]
    return Diagnosis(
        snapshot=str(directory),
        iteration=analysis.iteration,
        grad_norm=analysis.grad_norm,
        spike_ratio=analysis.spike_ratio,
        causes=likely if likely[0].family == "natural_spike" else found,
        next_steps=steps,
        checked=checked,
        not_checked=not_checked,
        consistency=consistency,
        log=point,
        attribution_top=top_rows,
        routes=routes,
        step=step,
        reading=reading,
        hypotheses=hypotheses,
    )


def _hypotheses(
    directory: Path, step: StepEvidence | None, loss: Any, world: int, consistency: Consistency
) -> list[Experiment]:
    """Each rank's recorded loss against the replay's (a consistency check), and for a rank where they differ the
    hypothesis replays that would prove what it computed (`diagnosis.hypotheses`); none without the loss channel."""
    channel = step.channel if step is not None else None
    if channel is None or not channel.rank_losses:
        return []
    check_replayed_losses(consistency, directory, channel.rank_losses)
    if loss is None:
        return []
    recorded = {rank: recorded_rank_loss(directory, rank) for rank in range(world)}
    out: list[Experiment] = []
    for mismatch in rank_mismatches(channel, recorded):
        out += loss_hypotheses(channel, mismatch, loss)
    return out


def _compare_ranks(
    directory: Path, step: StepEvidence | None, recorded: float, consistency: Consistency, not_checked: list[str]
) -> reproduction.Reproduction | None:
    """Each rank's recorded loss and per-parameter norms against the replay's (the replay's own per-rank check,
    `param_grad_norms_vs_replay`, made here too); None without the loss channel's per-rank norms."""
    from axrl_spike_replay.snapshot.rank_data import load_grad_info
    from axrl_spike_replay.snapshot.replayed_param_norms import NAME, check_replayed_param_norms

    channel = step.channel if step is not None else None
    if channel is None or not channel.rank_param_norms:
        return None
    infos: dict[int, dict[str, Any]] = {}
    for rank in sorted(rank_files(directory)["grad_info"]):
        try:
            infos[rank] = load_grad_info(directory, rank)
        except AxrlError:
            not_checked.append(f"rank {rank}'s record against the replay (grad info unreadable)")
            return None
    local = {r: n for r in infos if (n := channel.param_norms_of(r)) is not None}
    consistency.skipped.pop(NAME, None)
    if NAME in not_checked:
        not_checked.remove(NAME)
    not_checked[:] = [n for n in not_checked if not n.startswith(NAME)]
    check_replayed_param_norms(
        consistency, directory, None, local, reproduction.MATCH_TOLERANCE, "diagnose's replay (cpu, per rank)"
    )
    return reproduction.compare_ranks(infos, channel, recorded)


# stored signals a replay compares under the recorded routes: where those routes are off, the signal differs there too
ROUTE_MOVED = ("bad_ref_logprobs", "stale_old_logprobs", "engine_mismatch")


def _routes_before_what_they_move(found: list[Cause]) -> None:
    """A corrupt routing payload on ranks R comes before an equally strong stored-signal cause confined to R: the
    replay there runs the corrupt routes, so a signal the trainer computed with other routes (a reference worker
    routing on its own) differs from it there as well; `recompute=routes` on R separates the two readings. Where a
    witness holds the routes (1.0), such a signal is read as their symptom: at most TIED."""
    routes = next((c for c in found if c.family == "routing_payload" and c.strength >= causes.LIKELY and c.ranks), None)
    if routes is None:
        return
    on = set(routes.ranks)
    moved = [
        c for c in found if c.family in ROUTE_MOVED and c.strength <= routes.strength and c.ranks and set(c.ranks) <= on
    ]
    if not moved:
        return
    ahead = [c for c in moved if found.index(c) < found.index(routes)]
    if ahead:
        found.remove(routes)
        found.insert(found.index(ahead[0]), routes)
    where = ", ".join(str(r) for r in routes.ranks)
    for cause in moved:
        if routes.strength >= 1.0:  # witnessed routes: the signal they move is their symptom until shown otherwise
            cause.strength = min(cause.strength, TIED)
        cause.evidence.append(
            f"on rank {where}, whose routing payload is off: the replay there runs those routes, so this signal "
            f"differs there as well; `recompute=routes:rank{routes.ranks[0]}` tells whether the routes alone explain it"
        )


def _not_reproduced_first(found: list[Cause]) -> None:
    """A step that does not reproduce is explained before anything else is read into it (reproduction's doc)."""
    head = next(
        (c for c in found if c.family == "step_not_reproduced" and c.strength >= reproduction.UNEXPLAINED), None
    )
    if head is not None:
        found.remove(head)
        found.insert(0, head)


def mark_ties(found: list[Cause]) -> None:
    """Likely causes of different families whose strengths are within TIE, neither separated by a witness (1.0)
    nor on different ranks: capped at TIED, each naming the other. Two witnessed causes (1.0) on the same ranks tie
    as well, unless one is a failed input check (a fact about the snapshot): two stored inputs off on one rank are
    more often one fault upstream of both (the rank's tokens, its order, its routes) than two, so the comparison
    that separates them is run before either is called certain."""
    likely = [c for c in found if c.strength >= causes.LIKELY and c.family != "step_not_reproduced"]
    for a in likely:
        for b in likely:
            if a is b or abs(a.strength - b.strength) >= TIE or b.family in a.tied_with:
                continue
            if a.ranks and b.ranks and not set(a.ranks) & set(b.ranks):
                continue  # different ranks: two broken parts
            if (a.strength >= 1.0 or b.strength >= 1.0) and not _same_rank_readings(a, b):
                continue  # a witness separated each: two broken parts, not two readings of one
            a.tied_with.append(b.family)
    for c in likely:
        if c.tied_with:
            c.strength = min(c.strength, TIED)
            c.evidence.append(f"fits the evidence as well as: {', '.join(c.tied_with)} (the experiments separate them)")


def _same_rank_readings(a: Cause, b: Cause) -> bool:
    """Two witnessed causes read off the same ranks' stored inputs, neither a failed input check."""
    checked = any(c.figures.get("input_findings") for c in (a, b))
    # routes and a signal they move: `_routes_before_what_they_move` reads the signal as the routes' symptom
    moved = {a.family, b.family} & {"routing_payload"} and {a.family, b.family} & set(ROUTE_MOVED)
    return bool(a.ranks and b.ranks and set(a.ranks) & set(b.ranks)) and not checked and not moved


def _natural(found: list[Cause], reading: SignalReading | None) -> Cause:
    """No broken part found: the fallback, with what was checked."""
    weak = "; ".join(f"{c.title} {c.strength:.2f}" for c in found) or "no signal in any family"
    # a signal off alike on every rank with no witness (the policy's drift from the reference) singles nothing out
    agree = reading is not None and not any(o.separated for o in reading.odd)
    drift = [o.signal for o in reading.odd] if reading is not None else []
    evidence = [
        f"checked: {'; '.join(CHECKED.values())}",
        f"weaker signals (strength < {causes.LIKELY}): {weak}",
        "every stored signal agrees with the replay on every rank"
        if agree and not drift
        else f"no stored signal is singled out on a rank ({', '.join(drift)} off alike on every rank, unwitnessed)"
        if agree
        else "the stored signals were not compared with the replay (no model evidence): a broken part may be missed"
        if reading is None
        else "stored signals out of line: " + "; ".join(f"{o.signal} on rank {o.ranks}" for o in reading.odd),
        "whether the batch alone causes it: replay with `--mitigation initial_model=PATH` (the run's initial "
        "checkpoint); if the spike reproduces from the initial weights, the batch is the cause",
    ]
    strength = 0.5 if agree and not found else (0.35 if agree else 0.15)
    return Cause("natural_spike", "no broken part found: the batch is simply hard", strength, evidence, {}, [])


def render_diagnosis(d: Diagnosis) -> str:
    """Readable summary: the causes with their evidence, the experiments, consistency, what was not checked."""
    lines = [f"iteration {d.iteration}: grad norm {d.grad_norm:.6g} ({d.spike_ratio:.2f}x median)"]
    for i, cause in enumerate(d.causes, start=1):
        if cause.family != "natural_spike" and cause.strength < causes.LIKELY:
            lines.append(f"  (weak) {cause.title}: strength {cause.strength:.2f}")
            continue
        where = f" ranks {','.join(str(r) for r in cause.ranks)}" if cause.ranks else ""
        term = f" term {cause.term}" if cause.term else ""
        tied = f" (tied with {', '.join(cause.tied_with)})" if cause.tied_with else ""
        lines.append(f"{i}. {cause.title} [{cause.family}] strength {cause.strength:.2f}{where}{term}{tied}")
        lines += [f"   - {e}" for e in cause.evidence]
    channel = d.step.channel if d.step is not None else None
    if channel is not None and channel.terms:
        lines += ["", "gradient by loss term (share of ‖g‖², per rank):"]
        for t in sorted(channel.terms, key=lambda t: -abs(t.share)):
            per_rank = ", ".join(f"rank {x.rank} {x.share:.3g}" for x in t.ranks)
            lines.append(f"  {t.term}: {t.share:.3g} ({per_rank})")
    if d.hypotheses:
        lines += [
            "",
            "the step does not reproduce on some rank (its recorded loss is not the replay's): hypotheses, each "
            "making that rank's loss come out as recorded; the one the replay reproduces under (grad norm and every "
            "rank's loss) proves what the rank computed:",
        ]
        lines += [f"  --mitigation {e.mitigation}  # {e.why}" for e in d.hypotheses]
    if d.next_steps:
        lines += ["", "experiments, least invasive first:"]
        lines += [
            f"  --mitigation {e.mitigation}  # {e.why}" + (" (diagnostic only)" if e.diagnostic_only else "")
            for e in d.next_steps
        ]
    if d.consistency is not None:
        lines += ["", d.consistency.summary()]
        lines += [f"  problem [{p.name}]: {p.message}" for p in d.consistency.problems]
    if d.not_checked:
        lines += ["", "not checked:"] + [f"  {n}" for n in d.not_checked]
    if d.record:
        lines += ["", d.record]
    return "\n".join(lines)
