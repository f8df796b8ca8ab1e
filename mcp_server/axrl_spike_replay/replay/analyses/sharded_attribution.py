"""Attribution with the policy sharded by FSDP2 over several processes: no process holds the whole model or a whole
gradient, and the figures are attribution's own (`replay.analyses.attribution`).

Why not the unsharded way (one forward-mode pass along g): forward-mode AD does not run through FSDP2. A DTensor
parameter cannot carry a tangent (`make_dual` has no sharding rule), and FSDP2 all-gathers the shards into fresh
unsharded parameters with its own copy ops before each unit's forward, so a tangent given to the shards would never
reach the computation. Reverse mode is what FSDP2 supports, so each sample's gradient is taken by a backward:

1. **Gradient pass** (as a sharded replay, `replay.compute.gradient_space.Sharded`): every process forwards its saved
   ranks' batches micro-batch by micro-batch (one micro-batch's graph at a time), padded with zero-gradient
   passes so the collectives stay in step; the reduce-scattered sums, divided by the saved world size, are this
   process's rows of g. Each rank's dLoss/dlogprobs (and dLoss/dentropy) and the routes its forward took are kept;
   the router losses (batch-level) get their own backward.
2. **One sample at a time over the world**: for each sample in turn, its owner forwards that one row (routes
   replayed, so it routes as in the gradient pass: a sample's log-probs depend only on its own row) and backpropagates
   dLoss/dlogprobs of that row; every other process forwards one row of its own and backpropagates zeros. The
   reduce-scattered shards then hold exactly that sample's gradient, rows of it on each process.
   <g_s, g> is the float64 sum over this process's rows, and the sums of every sample are all-reduced once at the
   end. Gradients never travel whole; the memory is the shards plus one row's graph.

Cost: one one-row forward and backward per sample on every process (their collectives make the turns serial),
about as much compute as a replay pass over every rank batch, against the unsharded attribution's one forward-mode
pass; `benchmarks/bench_attribution.py` measures both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.models.policy import ModelSpec, policy_forward, routing_shape
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.analyses.rank_micro_batches import check_same_counts
from axrl_spike_replay.replay.analyses.sample_signals import RankGather, micro_steps
from axrl_spike_replay.replay.analyses.share_processes import run_share_processes
from axrl_spike_replay.replay.compute.gradient_space import Grads, Sharded, accumulate
from axrl_spike_replay.replay.compute.model_build import Placement, build_model
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, step_counts
from axrl_spike_replay.replay.compute.rank_passes import gather_objects

_ROW_KEYS = ("tokens", "loss_mask", "attention_mask")  # what a forward reads of a batch (`attribution._JVP_KEYS`)


@dataclass(frozen=True)
class AttributionJob:
    """What every process of a sharded attribution needs (pickled into the spawned processes)."""

    replay_dir: str
    model: ModelSpec
    cfg: AppliedConfig
    world_size: int  # saved DP world size: the reduction divides by it
    assignment: tuple[tuple[int, ...], ...]  # saved ranks per process
    device: str = "cpu"
    checkpoint_layers: bool = False  # decoder layers recompute their activations in the backward (the plan's)


@dataclass
class ShardedFigures:
    """What process 0 holds at the end: the replayed norm, the router losses' <., g> / W and, per saved rank, each
    sample's <g_s, g> / W and attribution's per-sample signals."""

    grad_norm: float
    router: float
    dots: dict[int, list[float]] = field(default_factory=dict)
    signals: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:  # read back from JSON: ranks are keys again
        self.dots = {int(r): v for r, v in self.dots.items()}
        self.signals = {int(r): v for r, v in self.signals.items()}


@dataclass
class _Kept:
    """A saved rank's gradient-pass figures, kept for its samples' turns."""

    batch: dict[str, torch.Tensor]
    grad_logprobs: torch.Tensor
    grad_entropy: torch.Tensor | None
    routes: torch.Tensor


def one_row(batch: dict[str, torch.Tensor], s: int) -> dict[str, torch.Tensor]:
    """Sample `s` of a rank batch as a batch of one, with what a forward reads."""
    return {k: batch[k][s : s + 1] for k in _ROW_KEYS if k in batch}


def local_dot(grads: Sequence[torch.Tensor | None], g: Sequence[torch.Tensor | None]) -> float:
    """Sum over this process's rows of <grads, g>, float64 (a missing gradient is zero)."""
    total = torch.zeros((), dtype=torch.float64)
    for a, b in zip(grads, g, strict=True):
        if a is not None and b is not None:
            total += (a.double() * b.double()).sum().cpu()
    return float(total)


def _gradient_pass(
    model: torch.nn.Module, space: Sharded, inputs: RankInputs, job: AttributionJob
) -> tuple[Grads, Grads | None, dict[int, _Kept], dict[int, list[dict[str, Any]]]]:
    """Step 1 of the module doc: (this process's rows of the summed gradient, of the router losses' summed gradient
    (None: no router loss), each own rank's kept figures, each own rank's signals)."""
    cfg = job.cfg
    counts = step_counts(inputs, cfg, cfg.loss, None, job.world_size)  # a collective, as the whole path's own count
    params = space.params
    total: Grads = [None] * len(params)
    router_sum: Grads = [None] * len(params)
    has_router = False
    kept: dict[int, _Kept] = {}
    signals: dict[int, list[dict[str, Any]]] = {}
    first = next(iter(inputs.batches))
    passes = space.passes(list(inputs.batches))
    check_same_counts(inputs, passes, "attribution", inputs.device)  # a collective: every process checks
    for rank in passes:
        own = first if rank is None else rank
        gather = RankGather(own, inputs.batches[own], inputs.plan(own))
        # micro-batch by micro-batch: one micro-batch's graph at a time (every process makes as many: checked above)
        for step in micro_steps(model, inputs, cfg, own, counts):
            result, router = step.result, step.router
            # a padding pass, or a rank the config leaves out: its backwards add nothing but keep the collectives in
            # step
            adds = rank is not None and step.kept
            scale = torch.ones_like(step.loss) if adds else torch.zeros_like(step.loss)
            accumulate(total, space.outputs_backward([step.loss], [scale], retain=router is not None))
            if router is not None:  # the same on every process: the config and the model decide it
                has_router = True
                # the loss rides along at zero: a router loss alone reaches a unit's parameters without passing
                # through the unit's output, where FSDP2 gathers them for the backward
                got = space.outputs_backward([router, step.loss], [scale, torch.zeros_like(step.loss)], retain=False)
                accumulate(router_sum, got)
            del result
            if rank is not None:
                gather.add(step)
            del step
        if rank is None:
            continue
        kept[rank] = _Kept(
            batch=inputs.batches[rank],
            grad_logprobs=gather.grad_logprobs_rows,
            grad_entropy=gather.grad_entropy_rows,
            routes=gather.routes_rows,
        )
        signals[rank] = gather.signals(cfg)
    return total, (router_sum if has_router else None), kept, signals


def _turns(inputs: RankInputs, kept: dict[int, _Kept]) -> list[tuple[int, int, int]]:
    """Every sample of the world as (process, saved rank, sample), in the same order on every process."""
    own = [(rank, int(k.grad_logprobs.shape[0])) for rank, k in kept.items()]
    turns = []
    for process, part in enumerate(gather_objects(own)):
        for rank, samples in part:
            turns.extend((process, rank, s) for s in range(samples))
    return turns


def _sample_dots(
    model: torch.nn.Module,
    space: Sharded,
    inputs: RankInputs,
    kept: dict[int, _Kept],
    g: list[torch.Tensor],
    process: int,
    cancel: threading.Event | None,
) -> dict[tuple[int, int], float]:
    """Step 2 of the module doc: this process's rows of <g_s, g> * W for every sample of the world (the caller
    all-reduces them)."""
    need_entropy = any(k.grad_entropy is not None for k in kept.values())
    filler_rank = next(iter(inputs.batches))
    filler = one_row(inputs.batches[filler_rank], 0)
    dots: dict[tuple[int, int], float] = {}
    for owner, rank, s in _turns(inputs, kept):
        check_cancel(cancel, "attribution")
        if owner == process:
            k = kept[rank]
            out = policy_forward(
                model, one_row(k.batch, s), RoutingControl(routes=k.routes[s : s + 1]), need_entropy=need_entropy
            )
            rows = [k.grad_logprobs[s : s + 1]] + ([k.grad_entropy[s : s + 1]] if k.grad_entropy is not None else [])
        else:  # a turn of another process's sample: take part in its collectives, add nothing
            out = policy_forward(model, filler, RoutingControl(), need_entropy=need_entropy)
            rows = [torch.zeros_like(out.logprobs)] + (
                [torch.zeros_like(out.entropy)] if out.entropy is not None else []
            )
        outputs = [out.logprobs] + ([out.entropy] if out.entropy is not None else [])
        dots[(rank, s)] = local_dot(space.outputs_backward(outputs, rows, retain=False), g)
    return dots


def all_reduce_sum(values: list[float], device: str) -> list[float]:
    """`values` summed over the process group, in float64 (as they are, outside one)."""
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu().tolist()


def attribute_share(job: AttributionJob, process: int, cancel: threading.Event | None = None) -> ShardedFigures:
    """This process's part of a sharded attribution (a collective: every process of the group calls it with the
    same job); every process returns the same figures."""
    start = time.perf_counter()
    inputs = RankInputs(job.replay_dir, job.assignment[process], job.device, routing_shape(job.model))
    placement = Placement(shard=True, checkpoint_layers=job.checkpoint_layers)
    model = build_model(job.model, job.cfg.weights or job.replay_dir, job.device, placement)
    space = Sharded(model, max(len(ranks) for ranks in job.assignment))
    t0 = time.perf_counter()
    total, router_sum, kept, signals = _gradient_pass(model, space, inputs, job)
    g = space.reduce(total, job.world_size)
    grad_norm, _ = space.norms(g)
    t1 = time.perf_counter()
    dots = _sample_dots(model, space, inputs, kept, g, process, cancel)
    order = sorted(dots)
    router_local = local_dot(router_sum, g) if router_sum is not None else 0.0
    summed = all_reduce_sum([dots[key] for key in order] + [router_local], job.device)
    t2 = time.perf_counter()
    per_rank: dict[int, list[float]] = {}
    for (rank, _), value in zip(order, summed[:-1], strict=True):
        per_rank.setdefault(rank, []).append(value / job.world_size)
    all_signals = {rank: rows for part in gather_objects(signals) for rank, rows in part.items()}
    return ShardedFigures(
        grad_norm=grad_norm,
        router=summed[-1] / job.world_size,
        dots=per_rank,
        signals=all_signals,
        timings={"load": t0 - start, "gradient": t1 - t0, "attribution": t2 - t1},
    )


def run_sharded_attribution(
    job: AttributionJob, timeout_s: float = RUN_TIMEOUT_S, cancel: threading.Event | None = None
) -> ShardedFigures:
    """The figures of a sharded attribution on `len(job.assignment)` spawned processes (gloo on CPU; nccl on CUDA
    with a GPU per process); process 0's view. Setting `cancel` stops every process (RunCancelled)."""
    return ShardedFigures(**run_share_processes(_figures, job, "attribution", timeout_s, cancel))


def _figures(job: AttributionJob, process: int) -> dict[str, Any]:
    return asdict(attribute_share(job, process))
