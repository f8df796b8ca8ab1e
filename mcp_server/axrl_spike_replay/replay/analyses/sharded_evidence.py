"""Diagnose's model evidence (`replay.analyses.step_evidence_forward`) with the policy sharded by FSDP2 over several
processes: the per-rank signal check and the loss channel, each process on its own saved ranks, gathered on process 0.
No process
holds the whole model or a whole gradient.

- **Signals** (forward only): each process runs the signal check of its own ranks (`step_evidence.signal_check`).
  Every FSDP2 forward is a collective, whatever batch and routing it computes, so the processes only need to make
  the same number of forwards: each counts its own, and those with fewer make one-row forwards until all have made
  the most. The per-rank rows are gathered on every process.
- **Channel**: micro-batch by micro-batch as the trainer split each rank's step (one micro-batch's graph at a time).
  A term's gradient on one saved rank exists only as a sum over processes in the shards, so each rank's term is
  taken in its own turns (one per micro-batch, summed): its process backpropagates the term, the others zeros, and
  the shards then hold that rank's term (its float64 sum of squares and dot with g are local sums, all-reduced).
  The terms summed over ranks, and g, build up from the same turns. A second round of turns takes each rank's term
  against g, as the unsharded channel does, and the whole loss once per pass (every process at once: only its sum
  is needed). Each rank's own per-parameter norms (its terms' turns summed: its whole-loss gradient before the
  mean, what its recorded norms are compared with) are float64 sums of squares per parameter over the shards,
  all-reduced once.
  A backward always carries the whole loss at zero beside its term: a router loss alone reaches a unit's parameters
  without passing through the unit's output, where FSDP2 gathers them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.experiment.step_evidence import (
    LayerRoutes,
    LossChannel,
    PairFigures,
    RankSignals,
    SignalCheck,
    TermFigures,
    TermRank,
)
from axrl_spike_replay.models.policy import policy_forward, routing_shape
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.analyses.rank_micro_batches import check_same_counts
from axrl_spike_replay.replay.analyses.sharded_attribution import all_reduce_sum, local_dot, one_row
from axrl_spike_replay.replay.analyses.share_processes import run_share_processes
from axrl_spike_replay.replay.analyses.step_evidence_forward import (
    MAX_ROUTE_LAYERS,
    micro_terms,
    pull_of,
    signal_check,
    top_samples,
    top_tokens,
)
from axrl_spike_replay.replay.compute.gradient_space import Grads, Sharded, accumulate
from axrl_spike_replay.replay.compute.model_build import Placement, build_model
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, step_counts
from axrl_spike_replay.replay.compute.rank_passes import gather_objects
from axrl_spike_replay.replay.reading.inputs import ReplayInputs
from axrl_spike_replay.snapshot.rank_data import load_rank_routes


@dataclass(frozen=True)
class EvidenceJob:
    """What every process of a sharded model-evidence run needs (pickled into the spawned processes)."""

    inputs: ReplayInputs
    cfg: AppliedConfig
    assignment: tuple[tuple[int, ...], ...]  # saved ranks per process
    device: str = "cpu"
    channel: bool = True
    checkpoint_layers: bool = False  # decoder layers recompute their activations in the backward (the plan's)


def _all_reduce_max(value: int, device: str) -> int:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def sharded_signals(
    model: torch.nn.Module, ranks: RankInputs, job: EvidenceJob, cancel: threading.Event | None = None
) -> SignalCheck:
    """The signal check of every saved rank, each process forwarding its own (see the module doc). The count of
    forwards is agreed before the first: FSDP2 gathers the root's parameters on the first no-grad forward only, so
    padding after another collective would meet the others' forwards out of order."""
    planned = _planned_forwards(ranks, job)
    most = _all_reduce_max(planned, ranks.device)
    forwards = [0]

    def count(*_: Any) -> None:
        forwards[0] += 1

    handle = model.register_forward_pre_hook(count)
    try:
        own = signal_check(model, ranks, job.inputs, job.cfg, cancel)
    finally:
        handle.remove()
    if forwards[0] != planned:
        raise AxrlError(f"sharded signal check: {forwards[0]} forwards made, {planned} planned (the processes' differ)")
    filler = one_row(next(iter(ranks.batches.values())), 0)
    with torch.no_grad():
        for _ in range(most - planned):
            policy_forward(model, filler, RoutingControl(), need_entropy=False)
    rows = sorted((r for part in gather_objects(own.ranks) for r in part), key=lambda r: r.rank)
    return replace(own, ranks=rows)


def _planned_forwards(ranks: RankInputs, job: EvidenceJob) -> int:
    """The forwards `step_evidence.signal_check` makes for this process's ranks: the run's routing, the model's own
    when the run replays routes, and one per recorded MoE layer of a rank with routes."""
    replays = job.cfg.routing.replay != "off"
    total = 0
    for rank, batch in ranks.batches.items():
        total += (1 + int(replays)) * len(ranks.plan(rank))  # a forward per micro-batch (`rank_micro_batches`)
        if rank in job.inputs.routing_ranks:
            payload = load_rank_routes(ranks.replay_dir, rank, batch=batch)
            total += len(payload.moe_layers[:MAX_ROUTE_LAYERS]) if payload is not None else 0
    return total


def _turn(space: Sharded, term: torch.Tensor, whole: torch.Tensor, mine: bool) -> Grads:
    """One backward of `term` (zeros unless `mine`), the whole loss riding along at zero (see the module doc)."""
    scale = torch.ones_like(term) if mine else torch.zeros_like(term)
    return space.outputs_backward([term, whole], [scale, torch.zeros_like(whole)], retain=True)


def _rows(param: torch.Tensor) -> torch.Tensor:
    """Zeros shaped as this process's rows of a parameter."""
    from torch.distributed.tensor import DTensor

    return torch.zeros_like(param.to_local() if isinstance(param, DTensor) else param)


def _local(grads: Grads, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [_rows(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def sharded_channel(
    model: torch.nn.Module,
    space: Sharded,
    ranks: RankInputs,
    job: EvidenceJob,
    process: int,
    cancel: threading.Event | None = None,
) -> LossChannel:
    """The reduced gradient split by loss term, per rank, from the shards (see the module doc)."""
    inputs, cfg = job.inputs, job.cfg
    world = inputs.world_size
    params = space.params
    counts = step_counts(ranks, cfg, inputs.loss, inputs.counts, world)  # a collective
    passes = space.passes(list(ranks.batches))
    check_same_counts(ranks, passes, "the loss channel", ranks.device)  # a collective: every process checks
    owners = [[(p, own[k]) for p, own in enumerate(job.assignment) if k < len(own)] for k in range(len(passes))]
    first = next(iter(ranks.batches))
    sums: dict[str, Grads] = {}
    squares: dict[tuple[str, int], float] = {}
    pulls: dict[str, dict[int, torch.Tensor]] = {}
    values: dict[tuple[str, int], float] = {}  # this process's own ranks' term values, and `_loss`
    param_squares: dict[int, list[float]] = {}  # per saved rank, this process's rows of ||g_r,param||^2
    for k, rank in enumerate(passes):
        check_cancel(cancel, "diagnosis")
        own = first if rank is None else rank
        size, width = (int(n) for n in ranks.batches[own]["tokens"].shape[:2])
        turns: dict[tuple[str, int], Grads] = {}  # each owned rank's term, summed over its micro-batches
        loss = 0.0
        # micro-batch by micro-batch (every process makes as many: checked above), one micro-batch's graph at a time
        for mb, terms, out in micro_terms(model, ranks, cfg, own, counts):
            whole = terms.pop("_loss")
            loss += float(whole.detach())
            extra = [out.logprobs] + ([out.entropy] if out.entropy is not None else [])
            for name, term in terms.items():
                # every process takes this backward on every pass, a padding one too: the log-probs are an output of
                # the sharded model (the chunked head ends its forward), so FSDP2's final callback reduces after it, a
                # collective every process must join
                wrt = torch.autograd.grad(term, extra, retain_graph=True, allow_unused=True)
                if rank is not None:
                    values[(name, rank)] = values.get((name, rank), 0.0) + float(term.detach())
                    pull = pulls.setdefault(name, {}).setdefault(rank, torch.zeros(size, width, dtype=torch.float64))
                    pull[list(mb.rows), : mb.width] += pull_of(list(wrt), out.logprobs.shape)
                for p, owned in owners[k]:
                    accumulate(
                        turns.setdefault((name, owned), [None] * len(params)), _turn(space, term, whole, p == process)
                    )
            del terms, out, whole
        if rank is not None:
            values[("_loss", rank)] = loss
        own_whole: dict[int, Grads] = {}  # each owned rank's whole-loss gradient (the sum of its terms'), my rows
        for (name, owned), got in turns.items():
            squares[(name, owned)] = local_dot(got, got)
            accumulate(
                own_whole.setdefault(owned, [None] * len(params)), [None if x is None else x.clone() for x in got]
            )
            accumulate(sums.setdefault(name, [None] * len(params)), got)
        for owned, grads in own_whole.items():
            param_squares[owned] = [0.0 if x is None else float(x.double().pow(2).sum()) for x in grads]
        del turns, own_whole
    keys = sorted(squares)
    names = list(sums)
    term_g = {name: [x / world for x in _local(sums[name], params)] for name in names}
    g = [_rows(p) for p in params]
    for name in names:
        g = [a + b for a, b in zip(g, term_g[name], strict=True)]
    figures = [local_dot(g, g)]
    for name in names:
        figures += [local_dot(term_g[name], term_g[name]), local_dot(term_g[name], g)]
    summed = all_reduce_sum([squares[key] for key in keys] + figures, ranks.device)
    norms = {key: math.sqrt(v) / world for key, v in zip(keys, summed[: len(keys)], strict=True)}
    g_sq = summed[len(keys)]
    per_term = summed[len(keys) + 1 :]
    dots, full = _second_round(model, space, ranks, job, process, g, counts, passes, owners, cancel)
    diff = [a / world - b for a, b in zip(_local(full, params), g, strict=True)]
    against = all_reduce_sum([dots[key] for key in keys] + [local_dot(diff, diff)], ranks.device)
    shares = {key: v / world / g_sq if g_sq > 0 else 0.0 for key, v in zip(keys, against[:-1], strict=True)}
    masks = {r: b["loss_mask"].cpu() for r, b in ranks.batches.items()}
    all_pulls: dict[str, dict[int, torch.Tensor]] = {}
    all_masks: dict[int, torch.Tensor] = {}
    all_values: dict[tuple[str, int], float] = {}
    for part_pulls, part_masks, part_values in gather_objects((pulls, masks, values)):
        for name, by_rank in part_pulls.items():
            all_pulls.setdefault(name, {}).update(by_rank)
        all_masks.update(part_masks)
        all_values.update(part_values)
    coefs = {"kl": cfg.loss.kl_coef, "entropy": cfg.loss.entropy_coef, "aux": cfg.loss.aux_loss_coef}
    coefs["z"] = cfg.loss.z_loss_coef
    channel = LossChannel(grad_norm=math.sqrt(g_sq), sum_rel_error=math.sqrt(against[-1] / g_sq) if g_sq > 0 else 0.0)
    channel.rank_losses = [{"rank": r, "loss": v} for (n, r), v in sorted(all_values.items()) if n == "_loss"]
    channel.rank_param_norms = _rank_param_norms(space, param_squares, ranks.device)
    for i, name in enumerate(names):
        t_sq, t_dot = per_term[2 * i], per_term[2 * i + 1]
        owned = sorted(r for n, r in keys if n == name)
        channel.terms.append(
            TermFigures(
                term=name,
                coef=float(coefs.get(name, 1.0)),
                grad_norm=math.sqrt(t_sq),
                share=t_dot / g_sq if g_sq > 0 else 0.0,
                ranks=[TermRank(r, norms[(name, r)], shares[(name, r)], all_values.get((name, r))) for r in owned],
                top_tokens=top_tokens(all_pulls.get(name, {}), all_masks),
                top_samples=top_samples(all_pulls.get(name, {})),
            )
        )
    return channel


def _rank_param_norms(space: Sharded, squares: dict[int, list[float]], device: str) -> list[dict[str, Any]]:
    """Each saved rank's per-parameter norms of its own whole-loss gradient (before the data-parallel mean), summed
    over every process's rows: what its recorded per-parameter norms are compared with (`diagnosis.reproduction`)."""
    owned = sorted(squares)
    count = len(space.params)
    summed = all_reduce_sum([v for r in owned for v in squares[r]], device)
    return [
        {
            "rank": r,
            "norms": {
                n: math.sqrt(max(0.0, v)) for n, v in zip(space.names, summed[i * count : (i + 1) * count], strict=True)
            },
        }
        for i, r in enumerate(owned)
    ]


def _second_round(
    model: torch.nn.Module,
    space: Sharded,
    ranks: RankInputs,
    job: EvidenceJob,
    process: int,
    g: list[torch.Tensor],
    counts: Any,
    passes: list[int | None],
    owners: list[list[tuple[int, int]]],
    cancel: threading.Event | None,
) -> tuple[dict[tuple[str, int], float], Grads]:
    """Each rank's terms against g (this process's rows of the dots), and the whole loss summed over ranks."""
    first = next(iter(ranks.batches))
    dots: dict[tuple[str, int], float] = {}
    full: Grads = [None] * len(g)
    for k, rank in enumerate(passes):
        check_cancel(cancel, "diagnosis")
        for _, terms, out in micro_terms(model, ranks, job.cfg, first if rank is None else rank, counts):
            whole = terms.pop("_loss")
            for name, term in terms.items():
                for p, owned in owners[k]:  # linear: the micro-batches' dots add up to the rank's
                    dot = local_dot(_turn(space, term, whole, p == process), g)
                    dots[(name, owned)] = dots.get((name, owned), 0.0) + dot
            scale = torch.ones_like(whole) if rank is not None else torch.zeros_like(whole)
            accumulate(full, space.outputs_backward([whole], [scale], retain=False))
            del terms, out, whole
    return dots, full


def evidence_share(
    job: EvidenceJob, process: int, cancel: threading.Event | None = None
) -> tuple[SignalCheck, LossChannel | None]:
    """This process's part of the sharded model evidence (a collective: every process calls it with the same job);
    every process returns the same figures."""
    inputs = job.inputs
    ranks = RankInputs(inputs.replay_dir, job.assignment[process], job.device, routing_shape(inputs.model))
    placement = Placement(shard=True, checkpoint_layers=job.checkpoint_layers)
    model = build_model(inputs.model, job.cfg.weights or inputs.replay_dir, job.device, placement)
    # the parameters are taken now, as shards: after a no-grad forward FSDP2 leaves the root's unsharded
    space = Sharded(model, max(len(own) for own in job.assignment))
    signals = sharded_signals(model, ranks, job, cancel)
    if not job.channel:
        return signals, None
    return signals, sharded_channel(model, space, ranks, job, process, cancel)


def signal_check_of(doc: dict[str, Any]) -> SignalCheck:
    """A SignalCheck from its `to_json` document (our own file, from the sharded processes)."""
    rows = [
        RankSignals(
            rank=r["rank"],
            pairs={k: PairFigures(**v) for k, v in r["pairs"].items()},
            routes=[LayerRoutes(**x) for x in r["routes"]],
            samples=r["samples"],
            samples_mean_logprob=r["samples_mean_logprob"],
            samples_mean_logprob_own=r["samples_mean_logprob_own"],
            samples_mean_entropy=r["samples_mean_entropy"],
            samples_tail=r["samples_tail"],
            shifted=r.get("shifted", {}),
        )
        for r in doc["ranks"]
    ]
    return SignalCheck(ranks=rows, routing_replay=doc["routing_replay"], base=doc["base"], has_own=doc["has_own"])


def loss_channel_of(doc: dict[str, Any]) -> LossChannel:
    """A LossChannel from its `to_json` document."""
    terms = [TermFigures(**{**t, "ranks": [TermRank(**r) for r in t["ranks"]]}) for t in doc["terms"]]
    return LossChannel(
        grad_norm=doc["grad_norm"],
        terms=terms,
        sum_rel_error=doc["sum_rel_error"],
        rank_losses=list(doc.get("rank_losses") or []),
        rank_param_norms=list(doc.get("rank_param_norms") or []),
    )


def run_sharded_evidence(
    job: EvidenceJob, timeout_s: float = RUN_TIMEOUT_S, cancel: threading.Event | None = None
) -> tuple[SignalCheck, LossChannel | None]:
    """The model evidence on `len(job.assignment)` spawned processes (gloo on CPU; nccl with a GPU per process)."""
    doc = run_share_processes(_evidence, job, "diagnosis", timeout_s, cancel)
    channel = loss_channel_of(doc["channel"]) if doc["channel"] is not None else None
    return signal_check_of(doc["signals"]), channel


def _evidence(job: EvidenceJob, process: int) -> dict[str, Any]:
    signals, channel = evidence_share(job, process)
    return {"signals": signals.to_json(), "channel": channel.to_json() if channel else None}
