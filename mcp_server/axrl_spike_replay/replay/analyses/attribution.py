"""Which samples carry the spike: each sample's contribution to the global (DP-mean) gradient.

With g the replayed global gradient and g_s sample s's share of it, c_s = <g_s, g> / ||g||; the
c_s plus one batch-level term (the router aux/z losses, which are not per-sample) sum to ||g||.

Cost: the replay's forward + backward per rank batch gives g, dLoss/dlogits (G) and the router
losses' gradient (one extra backward of those on the same graph); then one forward-mode pass (JVP)
along g over all rank batches at once gives (J g) for every sample's logits, and
<g_s, g> = (1/W) sum_{t,v} G[s,t,v] * (J g)[s,t,v]: the policy loss depends on a sample's logits
only through its own row (masks, denominators and detached weights are constants). No backward
per sample is needed; `method="per_sample_backward"` does that naive way, for checks and benchmarks.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S, ReplayRequest
from axrl_spike_replay.experiment.result import ATTRIBUTION_FILE, Attribution, SampleContribution
from axrl_spike_replay.experiment.run_dir import RunDir, RunRecorder, command_line
from axrl_spike_replay.experiment.verdict import rel_diff
from axrl_spike_replay.models.policy import policy_forward, routing_shape
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.processes.run_limit import time_limited
from axrl_spike_replay.replay.analyses.sample_signals import RankGather, base_name, cut_rows, micro_steps
from axrl_spike_replay.replay.compute.model_build import Placement, build_model
from axrl_spike_replay.replay.compute.outcome_figures import jvp_policy
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, step_counts
from axrl_spike_replay.replay.engine import check_device, replay_dir_for
from axrl_spike_replay.replay.plans.layout_plan import plan_layout
from axrl_spike_replay.replay.plans.shard_choice import (
    STREAMED_REASON,
    ShardChoice,
    check_whole_fits,
    whole_or_sharded_planned,
)
from axrl_spike_replay.replay.reading.inputs import ReplayInputs, load_inputs, one_config
from axrl_spike_replay.training.micro_batches import MicroBatch, stitch, take, take_routing
from axrl_spike_replay.training.rank_step import global_grad_norm, reduce_gradients
from axrl_spike_replay.training.sample_masks import check_ranks
from axrl_spike_replay.vocabulary import Fidelity, Method, Shard


@dataclass
class _RankPass:
    batch: dict[str, torch.Tensor]  # the saved rank batch the forward saw
    plan: list[MicroBatch]  # its micro-batches, as the trainer split it
    grad_logprobs: torch.Tensor  # [B, T] dLoss_r/dlogprobs
    grad_entropy: torch.Tensor | None  # [B, T] dLoss_r/dentropy; None when the loss has no entropy term
    routes: RoutingControl  # replays the experts this pass used, so later passes route the same
    signals: list[dict[str, Any]]


def _gradient_pass(
    model: torch.nn.Module, ranks: RankInputs, cfg: AppliedConfig
) -> tuple[dict[int, _RankPass], list[torch.Tensor] | None]:
    """Accumulate every rank's gradients in `.grad` (as a reduced replay does), micro-batch by micro-batch (one
    micro-batch's graph at a time); keep dLoss/dlogprobs (and dLoss/dentropy) per rank and the router losses'
    gradient summed over ranks."""
    params = list(model.parameters())
    # every saved rank is here: the step's counts are this process's own (the recorded ones, recounted)
    counts = step_counts(ranks, cfg, cfg.loss, None, len(ranks.batches))
    passes = {}
    router_sum: list[torch.Tensor] | None = None
    for rank, saved in ranks.batches.items():
        gather = RankGather(rank, saved, ranks.plan(rank))
        for step in micro_steps(model, ranks, cfg, rank, counts):
            if step.router is not None and step.kept:
                grads = torch.autograd.grad(step.router, params, retain_graph=True, allow_unused=True)
                grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
                router_sum = grads if router_sum is None else [a + b for a, b in zip(router_sum, grads, strict=True)]
            if step.kept:  # a rank the config leaves out adds nothing to the step
                step.loss.backward()
            gather.add(step)
            del step
        passes[rank] = _RankPass(
            batch=saved,
            plan=gather.plan,
            grad_logprobs=gather.grad_logprobs_rows,
            grad_entropy=gather.grad_entropy_rows,
            routes=RoutingControl(routes=gather.routes_rows),
            signals=gather.signals(cfg),
        )
    return passes, router_sum


_JVP_KEYS = ("tokens", "loss_mask", "attention_mask")
JOIN_TOKENS = 4096  # micro-batches of one width are joined into one forward-mode pass up to this many tokens


def _joined(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """The forward's inputs of several micro-batches as one batch; None when they cannot be concatenated."""
    keys = [k for k in _JVP_KEYS if k in batches[0]]
    if any(set(k for k in _JVP_KEYS if k in b) != set(keys) for b in batches):
        return None
    if len({b["tokens"].shape[1] for b in batches}) > 1:
        return None
    return {k: torch.cat([b[k] for b in batches]) for k in keys}


def _units(passes: dict[int, _RankPass]) -> list[list[tuple[int, int]]]:
    """Every (rank, micro-batch index), grouped into forward-mode passes: consecutive micro-batches of one width
    while the group holds at most the largest micro-batch's tokens (or JOIN_TOKENS): a pass's peak stays one
    micro-batch's, as the plan counts, and small steps take few passes."""
    items = [(r, i, p.plan[i]) for r, p in passes.items() for i in range(len(p.plan))]
    budget = max([JOIN_TOKENS] + [len(mb.rows) * mb.width for _, _, mb in items])
    groups: list[list[tuple[int, int]]] = []
    tokens, width = 0, -1
    for rank, i, mb in items:
        size = len(mb.rows) * mb.width
        if not groups or mb.width != width or tokens + size > budget:
            groups.append([])
            tokens, width = 0, mb.width
        groups[-1].append((rank, i))
        tokens += size
    return groups


def _jvp_all(
    model: torch.nn.Module, passes: dict[int, _RankPass], direction: dict[str, torch.Tensor]
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """J g for every rank's log-probs (and entropies), micro-batch by micro-batch; micro-batches that fit one pass
    (`_units`) go through one concatenated forward.

    Exact: a sample's log-probs depend only on its own tokens (and mask), and the routes are the ones the gradient
    pass used. Positions before a micro-batch's own first response position get log-probs in a joined forward;
    their dLoss/dlogprobs is 0, so they add nothing."""
    need_entropy = next(iter(passes.values())).grad_entropy is not None
    parts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for group in _units(passes):
        cut = []
        for rank, i in group:
            p, mb = passes[rank], passes[rank].plan[i]
            size = int(p.batch["tokens"].shape[0])
            cut.append((take(p.batch, mb), take_routing(p.routes, mb, size)))
        joined = _joined([b for b, _ in cut]) if len(cut) > 1 else None
        if joined is None:
            for (rank, i), (batch, routes) in zip(group, cut, strict=True):
                parts[rank, i] = jvp_policy(model, batch, routes, direction, need_entropy)
            continue
        routes = RoutingControl(routes=torch.cat([_routes_of(r) for _, r in cut]))
        d_logprobs, d_entropy = jvp_policy(model, joined, routes, direction, need_entropy)
        sizes = [int(b["tokens"].shape[0]) for b, _ in cut]
        parts_ent = d_entropy.split(sizes) if d_entropy is not None else [None] * len(cut)
        for key, lp, ent in zip(group, d_logprobs.split(sizes), parts_ent, strict=True):
            parts[key] = (lp, ent)
    out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for rank, p in passes.items():
        size, width = int(p.batch["tokens"].shape[0]), int(p.batch["tokens"].shape[1])
        mine = [parts[rank, i] for i in range(len(p.plan))]
        if len(mine) == 1 and mine[0][0].shape == (size, width):
            out[rank] = mine[0]
            continue
        ent = [e for _, e in mine if e is not None]
        out[rank] = (
            stitch([lp for lp, _ in mine], p.plan, size, width),
            stitch(ent, p.plan, size, width) if len(ent) == len(mine) else None,
        )
    return out


def _routes_of(control: RoutingControl) -> torch.Tensor:
    routes = control.routes
    assert routes is not None  # the gradient pass always records the routes it used
    return routes


def _backward_per_sample(model: torch.nn.Module, rank_pass: _RankPass, g: list[torch.Tensor]) -> torch.Tensor:
    """The naive way: one backward pass per sample, micro-batch by micro-batch; each sample's <grad, g>
    (float64)."""
    params = list(model.parameters())
    batch, need_entropy = rank_pass.batch, rank_pass.grad_entropy is not None
    size = int(batch["tokens"].shape[0])
    dots = torch.zeros(size, dtype=torch.float64)
    for mb in rank_pass.plan:
        routes = take_routing(rank_pass.routes, mb, size)
        out = policy_forward(model, take(batch, mb), routes, need_entropy=need_entropy)
        grads_out = [cut_rows(rank_pass.grad_logprobs, mb)]
        outputs = [out.logprobs]
        if rank_pass.grad_entropy is not None and out.entropy is not None:
            grads_out.append(cut_rows(rank_pass.grad_entropy, mb))
            outputs.append(out.entropy)
        for j, s in enumerate(mb.rows):
            rows = []
            for full in grads_out:
                row = torch.zeros_like(full)
                row[j] = full[j]
                rows.append(row)
            grads = torch.autograd.grad(outputs, params, grad_outputs=rows, retain_graph=True, allow_unused=True)
            dots[s] = sum(
                float((a.double() * b.double()).sum()) for a, b in zip(grads, g, strict=True) if a is not None
            )
        del out, outputs
    return dots


def _contributions(
    model: torch.nn.Module,
    passes: dict[int, _RankPass],
    router_sum: list[torch.Tensor] | None,
    world_size: int,
    method: str,
) -> tuple[dict[int, torch.Tensor], float]:
    """Per rank, each sample's <g_s, g> (float64); and the router losses' <., g>."""
    g = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    router = 0.0
    if router_sum is not None:
        router = sum(float((a.double() * b.double()).sum()) for a, b in zip(router_sum, g, strict=True)) / world_size
    if method == "jvp":
        direction = {name: grad for (name, _), grad in zip(model.named_parameters(), g, strict=True)}
        tangents = _jvp_all(model, passes, direction)
        dots = {r: _dot_rows(p, *tangents[r]) / world_size for r, p in passes.items()}
    else:
        dots = {r: _backward_per_sample(model, p, g) / world_size for r, p in passes.items()}
    return dots, router


def _dot_rows(rank_pass: _RankPass, d_logprobs: torch.Tensor, d_entropy: torch.Tensor | None) -> torch.Tensor:
    """Per sample, sum_t G[s,t] * (J g)[s,t] over the log-probs (and the entropies), float64."""
    dots = (rank_pass.grad_logprobs.double() * d_logprobs.double()).sum(dim=1)
    if rank_pass.grad_entropy is not None and d_entropy is not None:
        dots = dots + (rank_pass.grad_entropy.double() * d_entropy.double()).sum(dim=1)
    return dots.cpu()


def attribute_spike(
    request: ReplayRequest,
    *,
    recorder: RunRecorder | None = None,
    timeout_s: float | None = None,
    checkpoint: bool | None = None,
) -> Attribution:
    """Rank the samples of the request's snapshot at its spike step by their contribution to the replayed global
    grad norm: `what.top` of them, each computed as `what.method` says, under `what.mitigations`; the request is
    taken as it is (`investigation.request.replay_request` builds and validates it, verb attribute).

    `how.shard`: off, the whole model in this process (one forward-mode pass, or one backward per sample with method
    per_sample_backward); on, FSDP2 over `how.nproc` spawned processes (default: the saved world size), one backward
    per sample (`replay.analyses.sharded_attribution`); auto, sharded when the whole model does not fit one process
    here; streamed, every saved rank in this process one decoder layer at a time, each sample's dot with g taken piece
    by piece (`replay.analyses.streamed_attribution`: two passes over the checkpoint, one backward per sample per
    piece). Each rank's step goes micro-batch by micro-batch as the trainer split it, the head in chunks, the decoder
    layers checkpointed as `checkpoint` says (None: as the replay plan of the layout says). `timeout_s` (default: the
    request's `where.timeout_s`) stops it after that many seconds (RunCancelled naming it) and bounds its processes'
    waits on each other. `recorder` opens the output dir (None: nothing written), named by `request.job` (default:
    the snapshot's job), its command.txt `request.command` (default: the equivalent CLI). Setting `request.cancel` stops
    the work between its stages (RunCancelled)."""
    what, how = request.what, request.how
    snapshot, top, method, mitigations = what.snapshot, what.top, str(what.method), dict(what.mitigations)
    device, shard, nproc = str(how.device), str(how.shard), how.nproc
    if method not in Method.values():
        raise ConfigError(f"`method` must be one of {', '.join(Method.values())}, got {method!r}", "method")
    if not isinstance(top, int) or top < 1:
        raise ConfigError(f"`top` must be an integer >= 1, got {top!r}", "top")
    check_device(device)
    start = time.perf_counter()
    with replay_dir_for(snapshot) as (replay_dir, legacy):
        inputs = load_inputs(snapshot, replay_dir, legacy)
        cfg = one_config(inputs, mitigations)
        check_ranks(cfg.samples, inputs.world_size)
        layout = plan_layout(inputs.world_size, nproc)
        streamed = shard == Shard.STREAMED
        if streamed:
            _check_streamed(inputs)
            sharded = ShardChoice(False, STREAMED_REASON, streamed=True)
        else:
            sharded = whole_or_sharded_planned(shard, inputs, device, layout.nproc, checkpoint)
        if not sharded.shard and not streamed:
            check_whole_fits(inputs.model, inputs.effective_precision, device, "attribution")
        job_name = request.job or inputs.job_name or "spike"
        run = recorder.open_run(job_name) if recorder is not None else RunDir(None)
        options = {"top": top, "device": device, "shard": shard if shard != "auto" else None, "nproc": nproc}
        run.write_command(request.command or command_line("attribute", str(snapshot), options))
        run.log(sharded.reason)
        limit = timeout_s if timeout_s is not None else request.where.timeout_s
        processes_s = limit or RUN_TIMEOUT_S  # how long its processes wait on each other
        with time_limited(request.cancel, limit, "attribution") as cancel:
            if streamed:
                if method != Method.PER_SAMPLE_BACKWARD:
                    run.log(
                        "streamed: g is never held whole for a forward-mode pass; one backward per sample per piece"
                    )
                attribution = _attribute_streamed(inputs, cfg, top, device, start, cancel, nproc, processes_s)
            elif sharded.shard:
                if method != Method.PER_SAMPLE_BACKWARD:
                    run.log("sharded: forward-mode JVPs do not run through FSDP2; one backward per sample instead")
                attribution = _attribute_sharded(
                    inputs, cfg, top, device, layout.assignment, start, processes_s, cancel, sharded.checkpoint
                )
            else:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    attribution = _attribute(inputs, cfg, top, device, method, start, cancel, sharded.checkpoint)
                finally:
                    torch.set_num_threads(threads)
    attribution.output_dir = str(run.path or "")
    run.log(f"attribution: grad norm {attribution.grad_norm:.6g}, sum check rel error {attribution.sum_rel_error:.2e}")
    run.write_json(ATTRIBUTION_FILE, attribution.to_json())
    return attribution


def _attribute(
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    top: int,
    device: str,
    method: str,
    start: float,
    cancel: threading.Event | None = None,
    checkpoint: bool = False,
) -> Attribution:
    world_size = inputs.world_size
    placement = Placement(checkpoint_layers=checkpoint)
    model = build_model(inputs.model, cfg.weights or inputs.replay_dir, device, placement)
    ranks = RankInputs(inputs.replay_dir, range(world_size), device, routing_shape(inputs.model))
    check_cancel(cancel, "attribution")
    t0 = time.perf_counter()
    passes, router_sum = _gradient_pass(model, ranks, cfg)
    check_cancel(cancel, "attribution")
    reduce_gradients(model, world_size)
    grad_norm = global_grad_norm(model)
    t1 = time.perf_counter()
    dots, router = _contributions(model, passes, router_sum, world_size, method)
    t2 = time.perf_counter()
    signals = {rank: rank_pass.signals for rank, rank_pass in passes.items()}
    timings = {"load": t0 - start, "gradient": t1 - t0, "attribution": t2 - t1, "total": time.perf_counter() - start}
    per_rank = {rank: values.tolist() for rank, values in dots.items()}
    return _assembled(inputs, cfg, top, device, method, grad_norm, router, per_rank, signals, timings)


def _check_streamed(inputs: ReplayInputs) -> None:
    """ConfigError naming what a streamed attribution does not do (`nproc` is bounded by the saved world size before):
    a model it cannot stream, tied embeddings (a sample's head half of the tied weight would be dotted with the
    embedding's gradient, complete only at the end of the backward)."""
    from axrl_spike_replay.models.hf_config import HFModelConfig
    from axrl_spike_replay.replay.streamed.layer_weights import check_streamable

    check_streamable(inputs.model, None)
    if isinstance(inputs.model, HFModelConfig) and inputs.model.config.get("tie_word_embeddings", False):
        raise ConfigError(
            "a streamed attribution of a policy with tied input and output embeddings is not built: each sample's "
            "head half of the tied weight needs the embedding's gradient, complete only at the end; use `shard` on "
            "or off",
            "shard",
        )


def _attribute_streamed(
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    top: int,
    device: str,
    start: float,
    cancel: threading.Event | None,
    nproc: int | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
) -> Attribution:
    """Each sample's <g_s, g> as per-piece dot products, one decoder layer at a time (`streamed_attribution`), the
    saved ranks split over `nproc` processes when more than one."""
    from axrl_spike_replay.replay.analyses.sharded_attribution import AttributionJob
    from axrl_spike_replay.replay.analyses.streamed_attribution import PASSES, streamed_dots, streamed_split_dots
    from axrl_spike_replay.replay.streamed.rank_chain import contiguous_blocks

    if nproc is not None and nproc > 1:
        blocks = tuple(contiguous_blocks(range(inputs.world_size), nproc))
        job = AttributionJob(inputs.replay_dir, inputs.model, cfg, inputs.world_size, blocks, device)
        figures = streamed_split_dots(job, timeout_s, cancel)
        grad_norm, router, dots, signals = figures.grad_norm, figures.router, figures.dots, figures.signals
        timings = figures.timings
    else:
        grad_norm, router, dots, signals, timings = streamed_dots(inputs, cfg, device, cancel)
    timings = {**timings, "total": time.perf_counter() - start}
    attribution = _assembled(
        inputs, cfg, top, device, Method.PER_SAMPLE_BACKWARD, grad_norm, router, dots, signals, timings
    )
    attribution.passes = PASSES
    return attribution


def _attribute_sharded(
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    top: int,
    device: str,
    assignment: tuple[tuple[int, ...], ...],
    start: float,
    timeout_s: float,
    cancel: threading.Event | None,
    checkpoint: bool = False,
) -> Attribution:
    from axrl_spike_replay.replay.analyses.sharded_attribution import AttributionJob, run_sharded_attribution

    job = AttributionJob(inputs.replay_dir, inputs.model, cfg, inputs.world_size, assignment, device, checkpoint)
    figures = run_sharded_attribution(job, timeout_s, cancel)
    timings = {**figures.timings, "total": time.perf_counter() - start}
    attribution = _assembled(
        inputs,
        cfg,
        top,
        device,
        Method.PER_SAMPLE_BACKWARD,
        figures.grad_norm,
        figures.router,
        figures.dots,
        figures.signals,
        timings,
    )
    attribution.sharded, attribution.world_size_used = True, len(assignment)
    return attribution


def non_finite_refusal(inputs: ReplayInputs, grad_norm: float) -> str:
    """Why the step of `inputs` cannot be attributed: its replayed gradient (norm `grad_norm`) is not finite."""
    meta = inputs.metadata
    return (
        f"{inputs.snapshot}: iteration {meta.iteration}'s replayed gradient is not finite (grad norm {grad_norm}, "
        f"recorded {meta.grad_norm}): no sample's share of a non-finite gradient is defined, so nothing is attributed. "
        "Find the non-finite values (`diagnose` names them) and attribute the step with them left out "
        "(`--mitigation drop_samples=RANK:SAMPLE,...`)"
    )


def _assembled(
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    top: int,
    device: str,
    method: str,
    grad_norm: float,
    router: float,
    dots: dict[int, list[float]],
    signals: dict[int, list[dict[str, Any]]],
    timings: dict[str, float],
) -> Attribution:
    """The Attribution of per-sample <g_s, g> (`dots`, per saved rank) and the router losses' <., g>; refused
    (`non_finite_refusal`) where the replayed gradient is not finite: no share of it is defined."""
    if not math.isfinite(grad_norm):
        raise SnapshotError(non_finite_refusal(inputs, grad_norm))
    rows = []
    for rank in sorted(signals):
        for sample_signals, dot in zip(signals[rank], dots[rank], strict=True):
            contribution = dot / grad_norm if grad_norm > 0 else 0.0
            share = contribution / grad_norm if grad_norm > 0 else 0.0
            rows.append(SampleContribution(contribution=contribution, share=share, **sample_signals))
    router_term = router / grad_norm if grad_norm > 0 else 0.0
    total = math.fsum(r.contribution for r in rows) + router_term
    rows.sort(key=lambda r: -r.contribution)
    meta = inputs.metadata
    return Attribution(
        snapshot=inputs.snapshot,
        grad_norm=grad_norm,
        recorded_grad_norm=meta.grad_norm,
        rel_diff=rel_diff(grad_norm, meta.grad_norm),
        fidelity=Fidelity.FULL,  # every saved rank's batch, reduced over the saved world size
        world_size_saved=inputs.world_size,
        total_samples=len(rows),
        samples=rows[:top],
        router_term=router_term,
        contribution_sum=total,
        sum_rel_error=abs(total - grad_norm) / grad_norm if grad_norm > 0 else 0.0,
        method=method,
        log_ratio_base=base_name(cfg),
        mitigations=dict(cfg.mitigations),
        device=device,
        resolved_mitigations=dict(cfg.resolved),
        timings=timings,
    )
