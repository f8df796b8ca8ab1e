"""One replay process: load weights and its saved ranks' batches, recompute gradients per config, reduce.

Configs that differ only in the loss share one forward pass per rank batch: the loss of each config
is backpropagated from the same graph (`retain_graph`) into its own gradient buffers. Reduction and
norms use `training.rank_step` exactly as the trainer does, so the baseline reproduces training.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.mitigation.recompute import Recompute
from axrl_spike_replay.experiment.result import Footprint
from axrl_spike_replay.models.policy import ModelSpec, RoutingShape, policy_forward, routing_shape
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.compute.clean_gradient import SpikeBar, not_reached_reason, smallest_count, token_order
from axrl_spike_replay.replay.compute.gradient_space import GradientSpace, Sharded, Whole, accumulate, padded_passes
from axrl_spike_replay.replay.compute.model_build import Placement, build_model
from axrl_spike_replay.replay.compute.outcome_figures import RankTrace, footprint_counts, merge_footprint
from axrl_spike_replay.replay.reading.input_checks import blank_tokens
from axrl_spike_replay.replay.reading.inputs import read_micro_batches, read_run_config
from axrl_spike_replay.replay.reading.route_check import check_route_shapes, check_route_values
from axrl_spike_replay.snapshot.layout import batch_file
from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.loss_normalization import GlobalCounts, all_reduce_counts
from axrl_spike_replay.training.micro_batches import MicroBatch, plan_micro_batches, stitch, take, take_routing
from axrl_spike_replay.training.policy_loss import LossOutput, local_counts, policy_loss
from axrl_spike_replay.training.precision import PrecisionPolicy
from axrl_spike_replay.training.rank_step import gradient_norms
from axrl_spike_replay.training.routing_replay import routing_control
from axrl_spike_replay.training.sample_masks import SampleFilter, TokenDrop, filtered_batch


@dataclass(frozen=True)
class WorkerJob:
    """Everything a replay process needs (pickled into spawned processes)."""

    replay_dir: str
    model: ModelSpec
    configs: tuple[AppliedConfig, ...]
    world_size: int  # saved DP world size: the reduction always divides by it
    assignment: tuple[tuple[int, ...], ...]
    device: str = "cpu"
    repeat: int = 1
    top: int = 10
    counts: GlobalCounts | None = None  # the step's recorded global counts (normalization global)
    spike_bar: SpikeBar | None = None  # the verdict's bar the clean gradient is cleaned under (None: no median)
    shard: bool = False  # FSDP2 over the replay's processes (`replay.compute.model_build`); False: each holds the
    # whole model
    precision: PrecisionPolicy | None = None  # the trainer's recorded policy (None: the model's own dtype)
    checkpoint_layers: bool = False  # decoder layers recompute their activations in the backward (the plan's choice)

    @property
    def placement(self) -> Placement:
        return Placement(shard=self.shard, precision=self.precision, checkpoint_layers=self.checkpoint_layers)


@dataclass
class ConfigOutcome:
    """One config's replayed gradients, as process 0 saw them after the reduction."""

    config_id: str
    grad_norms: list[float] = field(default_factory=list)  # one per repeat
    top_params: list[dict[str, Any]] = field(default_factory=list)
    rank_metrics: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    footprint: Footprint | None = None  # mitigated configs: loss tokens / samples masked or changed
    cosine_to_clean: float | None = None  # mitigated configs: cosine of the gradient with the clean gradient
    clean_gradient: dict[str, Any] | None = None  # how the clean gradient was made (the same for every config)
    # the baseline: its per-parameter norms, of the reduced gradient and of each saved rank's own gradient (what the
    # recorded ones are checked against; kept off the result file)
    param_grad_norms: dict[str, float] | None = None
    rank_param_grad_norms: dict[int, dict[str, float]] | None = None

    def __post_init__(self) -> None:
        if self.rank_param_grad_norms:  # read back from JSON (spawned processes): ranks are keys again
            self.rank_param_grad_norms = {int(rank): norms for rank, norms in self.rank_param_grad_norms.items()}


@dataclass
class _Figures:
    """What the outcome figures need across groups: the baseline's per-rank traces, then the clean gradient."""

    traces: dict[int, RankTrace] = field(default_factory=dict)  # baseline, per saved rank
    grad_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)  # baseline dLoss_r/dlogprobs [B, T]
    clean: list[torch.Tensor] | None = None
    info: dict[str, Any] | None = None
    seconds: float = 0.0  # spent on the clean gradient (the configs' `timings.clean_gradient`)


class _Kept:
    """Keeps the reduced gradients `reduce_and_measure` hands it (this process's shards, when sharded)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def __call__(self, grads: list[torch.Tensor]) -> None:
        self.grads = [g.detach() for g in grads]


def gradient_space(model: nn.Module, job: WorkerJob) -> GradientSpace:
    """How this process's gradients are taken and reduced for `job` (whole or sharded; see `gradient_space`)."""
    if job.shard:
        return Sharded(model, max(len(ranks) for ranks in job.assignment))
    recorded = job.precision is not None and job.precision.recorded
    return Whole(model, job.precision.torch_dtype("reduce_dtype") if recorded and job.precision else None)


def _to_device(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def forward_groups(configs: Sequence[AppliedConfig]) -> list[list[AppliedConfig]]:
    """Configs grouped by weights, then by forward (routing): snapshot weights first, order kept."""
    groups: dict[tuple[Any, ...], list[AppliedConfig]] = {}
    for cfg in sorted(configs, key=lambda c: c.weights is not None):
        groups.setdefault(cfg.forward_key, []).append(cfg)
    return list(groups.values())


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj`, in process order (`[obj]` in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class RankInputs:
    """A process's saved ranks: batches on the device, routing payloads read on first use and held to the
    model's routing (`shape`) before they reach the device."""

    def __init__(self, replay_dir: str, ranks: Sequence[int], device: str, shape: RoutingShape) -> None:
        self.replay_dir = replay_dir
        self.device = device
        self.shape = shape
        self.batches = {r: _to_device(load_rank_batch(replay_dir, r), device) for r in ranks}
        self._routes: dict[int, torch.Tensor] = {}
        doc = read_run_config(Path(replay_dir))
        spec = read_micro_batches(Path(replay_dir), doc)
        loss = dict(doc.get("loss") or {})
        self.plans = {
            r: plan_micro_batches(batch, spec, loss, Path(replay_dir) / batch_file(r))
            for r, batch in self.batches.items()
        }

    def plan(self, rank: int) -> list[MicroBatch]:
        """Rank `rank`'s micro-batches, as the trainer split its step (`training.micro_batches`)."""
        return self.plans[rank]

    def routes(self, rank: int) -> torch.Tensor:
        if rank not in self._routes:
            payload = load_rank_routes(self.replay_dir, rank, batch=self.batches[rank])
            if payload is None:  # load_inputs checked every rank a config replays routes of has some
                raise SnapshotError(f"{self.replay_dir}: rank {rank} has no recorded routes")
            check_route_shapes(payload, self.shape, tuple(self.batches[rank]["tokens"].shape))
            check_route_values(payload, self.shape, rank)
            self._routes[rank] = payload.routed_experts.to(self.device)
        return self._routes[rank]

    def routing(self, cfg: AppliedConfig, rank: int, left_out: bool = False) -> Any:
        """The forward's routing on saved rank `rank` under `cfg`. A rank whose every route is recomputed, or that
        every config of the forward leaves out (`left_out`: nothing of it reaches the step), routes as the model
        does: its recorded routes are not read, so a payload no computation is defined on does not stop them."""
        own = cfg.recompute.route_layers(rank)  # recompute=routes: this rank routes as the model does there
        if cfg.routing.replay != "off" and (own is None or left_out):
            return RoutingControl(current_layers=frozenset(cfg.routing.current_routing_layers))
        routes = self.routes(rank) if cfg.routing.replay != "off" else None
        control = routing_control(cfg.routing, self.batches[rank], routes)
        if own is None:
            return dataclasses.replace(control, routes=None, replay_tokens=None)
        if own:
            return dataclasses.replace(control, current_layers=control.current_layers | own)
        return control


def loss_batch(
    saved: dict[str, torch.Tensor],
    rank: int,
    cfg: AppliedConfig,
    logprobs: torch.Tensor,
    mb: MicroBatch | None = None,
) -> dict[str, Any]:
    """The batch a config's loss sees on `rank`: its samples filtered (`filtered_batch`, over the rank's whole
    batch), cut to the micro-batch `mb` the forward ran (None: the whole batch) and, under
    `recompute=old_logprobs` (`rollout_logprobs`), those log-probs replaced by the forward's own (detached)."""
    batch = filtered_batch(saved, rank, cfg.samples)
    if mb is not None:
        batch = take(batch, mb)
    for name in ("old_logprobs", "rollout_logprobs"):
        if cfg.recompute.logprobs(name, rank):
            dtype = saved[name].dtype if name in saved else logprobs.dtype
            batch = {**batch, name: logprobs.detach().to(dtype)}
    return batch


def config_loss(
    out: Any, batch: dict[str, Any], cfg: AppliedConfig, rank: int, counts: GlobalCounts | None, entropy: bool = True
) -> LossOutput:
    """The loss saved rank `rank` computes under `cfg` from its forward `out` on its (filtered) `batch`: with the
    rank's own settings under a hypothesis, and without the batch-level router losses on a rank the config leaves
    out (its samples are masked by `loss_batch`: a left-out rank contributes nothing to the step)."""
    kept = cfg.samples.keeps_rank(rank)
    return policy_loss(
        out.logprobs,
        batch,
        cfg.loss_of(rank),
        entropy=out.entropy if entropy else None,
        aux_loss=out.aux_loss if kept else None,
        z_loss=out.z_loss if kept else None,
        counts=counts,
    )


def _same_mask(a: LossConfig, b: LossConfig) -> bool:
    """Whether two loss configs count the same loss tokens (rejection sampling is what changes them)."""
    keys = ("convention", "rollout_rs", "rollout_rs_threshold", "ratio_outlier_mask")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def step_counts(
    inputs: RankInputs,
    cfg: AppliedConfig,
    saved: LossConfig,
    recorded: GlobalCounts | None,
    world_size: int,
) -> GlobalCounts | None:
    """The global counts a config normalises by: the recorded ones, or, when the config leaves out other tokens
    than the saved loss (rejection sampling, masked or dropped samples) or none were recorded, recounted over
    every saved rank (a collective: every process calls it for the same configs, and each counts its own ranks)."""
    if cfg.loss.normalization != "global":
        return None
    if recorded is not None and all(_same_mask(loss, saved) for loss in cfg.losses()) and not cfg.samples.active:
        return recorded
    tokens = sequences = 0.0
    for rank, batch in inputs.batches.items():
        t, s = local_counts(filtered_batch(batch, rank, cfg.samples), cfg.loss_of(rank))
        tokens, sequences = tokens + t, sequences + s
    return all_reduce_counts(tokens, sequences, world_size)


def forward_group(
    model: nn.Module,
    space: GradientSpace,
    inputs: RankInputs,
    group: Sequence[AppliedConfig],
    figures: _Figures | None = None,
    counts: Mapping[str, GlobalCounts | None] | None = None,
    local_norms: dict[int, dict[str, float]] | None = None,
    cancel: threading.Event | None = None,
) -> tuple[dict[str, list[torch.Tensor | None]], dict[str, list[dict[str, Any]]]]:
    """Gradients per config of a group over this process's saved ranks, as `space` keeps them: local sums (whole)
    or this process's rows of the sums over every process (sharded).

    Each rank's step is replayed as the trainer ran it, micro-batch by micro-batch (`inputs.plan`): one forward
    per micro-batch serves every config, each config's loss on it is scaled as the trainer scaled it and
    backpropagated, and the gradients add up; a process's peak holds one micro-batch's activations.

    With `figures`, the baseline's traces and dLoss/dlogprobs are kept there, and every mitigated config's
    footprint against them lands in its rank metrics (`_footprint`). With `local_norms`, each saved rank's
    per-parameter norms of its own baseline gradient (before the sum) land there. `cancel` is checked before each
    pass where this process computes alone (`within_config`)."""
    counts = counts or {}
    stop = within_config(cancel)
    names = [name for name, _ in model.named_parameters()]
    grads: dict[str, list[torch.Tensor | None]] = {cfg.config_id: [None] * len(names) for cfg in group}
    metrics: dict[str, list[dict[str, Any]]] = {cfg.config_id: [] for cfg in group}
    entropy_needed = any(cfg.needs_entropy for cfg in group)
    first = next(iter(inputs.batches))
    items = [(rank, mb) for rank in inputs.batches for mb in inputs.plan(rank)]
    steps: dict[str, _RankStep] = {}
    for item in padded_passes(space, items):
        check_cancel(stop, "replay")
        rank, mb = item if item is not None else (first, inputs.plan(first)[0])
        saved = inputs.batches[rank]
        size = int(saved["tokens"].shape[0])
        left_out = not any(cfg.samples.keeps_rank(rank) for cfg in group)  # nothing of it reaches the step
        routing = take_routing(inputs.routing(group[0], rank, left_out=left_out), mb, size)
        out = policy_forward(model, take(saved, mb), routing, need_entropy=entropy_needed)
        for i, cfg in enumerate(group):
            retain = i < len(group) - 1
            batch = loss_batch(saved, rank, cfg, out.logprobs, mb)
            result = config_loss(out, batch, cfg, rank, counts.get(cfg.config_id), cfg.needs_entropy)
            loss = result.loss * mb.scale if mb.scale != 1.0 else result.loss
            if item is None:  # a pass that keeps the collectives in step: it adds nothing of its own
                accumulate(grads[cfg.config_id], space.zero_backward(loss, retain))
                continue
            keep_logprobs = figures is not None and not cfg.mitigations and cfg.config_id == "baseline"
            step = steps.setdefault(cfg.config_id, _RankStep(rank, inputs.plan(rank)))
            if not cfg.samples.keeps_rank(rank):  # left out: nothing of this rank reaches the step, router terms too
                if space.sharded:
                    accumulate(grads[cfg.config_id], space.zero_backward(loss, retain))
                local, grad_logprobs = [], None
                step.extra["left_out"] = True
            else:
                local, grad_logprobs = space.backward(loss, out.logprobs if keep_logprobs else None, retain)
            step.add(result, mb.scale, grad_logprobs)
            # each saved rank's own gradient exists only whole; a sharded pass holds rows of the sum over processes
            if local_norms is not None and not space.sharded and cfg.config_id == "baseline" and not cfg.mitigations:
                step.keep_own(local, len(names))
            if step.done:  # measured before the sum takes this pass's gradient in (it may add into it in place)
                del steps[cfg.config_id]
                metrics[cfg.config_id].append(step.finish(cfg, figures, keep_logprobs, names, local_norms))
            accumulate(grads[cfg.config_id], local)
            # the pass's own gradient is in the sum now: a name still bound to it would keep a third copy alive
            # through the next pass's forward and backward (the sum, this one, and the next)
            del local, grad_logprobs, step
    return grads, metrics


def within_config(cancel: threading.Event | None) -> threading.Event | None:
    """`cancel` where this process computes alone (no process group of several), else None: the processes of a
    group check theirs together (a warm pool's agrees by a collective) at the same points, between configs and
    probes, while their passes inside a config need not match in number."""
    import torch.distributed as dist

    if cancel is None or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return cancel


class _RankStep:
    """One config's outputs over one rank's micro-batches, put together into the rank's once the last is in."""

    def __init__(self, rank: int, plan: Sequence[MicroBatch]) -> None:
        self.rank, self.plan = rank, list(plan)
        self.results: list[tuple[LossOutput, float]] = []
        self.grad_logprobs: list[torch.Tensor] = []
        self.own: list[torch.Tensor | None] = []  # the rank's own gradient (for its per-parameter norms)
        self.extra: dict[str, Any] = {}

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.plan)

    def keep_own(self, local: Sequence[torch.Tensor | None], count: int) -> None:
        """Add a micro-batch's gradient to the rank's own (one micro-batch: that gradient itself, no copy)."""
        if len(self.plan) == 1:
            self.own = list(local)
            return
        if not self.own:
            self.own = [None] * count
        accumulate(self.own, [g.clone() if g is not None else None for g in local])

    def add(self, result: LossOutput, scale: float, grad_logprobs: torch.Tensor | None) -> None:
        self.results.append((result, scale))
        if grad_logprobs is not None:
            self.grad_logprobs.append(grad_logprobs.detach())

    def finish(
        self,
        cfg: AppliedConfig,
        figures: _Figures | None,
        keep_logprobs: bool,
        names: Sequence[str],
        local_norms: dict[int, dict[str, float]] | None,
    ) -> dict[str, Any]:
        """The rank's metrics row; its trace (and dLoss/dlogprobs, and own norms) kept where asked for."""
        rank, extra = self.rank, self.extra
        if figures is not None:
            size, width = _shape_of(self.plan)
            trace = RankTrace(
                mask=stitch([r.mask.detach() for r, _ in self.results], self.plan, size, width),
                per_token=stitch([r.per_token.detach() for r, _ in self.results], self.plan, size, width),
            )
            if keep_logprobs and len(self.grad_logprobs) == len(self.plan):
                figures.traces[rank] = trace
                figures.grad_logprobs[rank] = stitch(self.grad_logprobs, self.plan, size, width)
            elif cfg.mitigations and not cfg.is_hypothesis and rank in figures.traces:
                extra["_footprint"] = footprint_counts(figures.traces[rank], trace)
        if local_norms is not None and self.own:
            local_norms[rank] = gradient_norms(zip(names, self.own[: len(names)], strict=False))
        return {"rank": rank, **rank_step_metrics(self.results), **extra}


def _shape_of(plan: Sequence[MicroBatch]) -> tuple[int, int]:
    return sum(len(mb.rows) for mb in plan), max(mb.width for mb in plan)


def rank_step_metrics(results: Sequence[tuple[LossOutput, float]]) -> dict[str, Any]:
    """A rank's metrics from its micro-batches' (loss output, scale): its loss the scaled sum, as the trainer's;
    token counts summed; maxima the largest; the other figures weighted by loss tokens. One micro-batch: its own."""
    if len(results) == 1 and results[0][1] == 1.0:
        result = results[0][0]
        return {"loss": float(result.loss.detach()), **result.metrics}
    out: dict[str, Any] = {"loss": sum(float(r.loss.detach()) * scale for r, scale in results)}
    keys = [k for k in results[0][0].metrics if all(k in r.metrics for r, _ in results)]
    tokens = [float(r.metrics.get("loss_tokens", 0.0)) for r, _ in results]
    for key in keys:
        values = [float(r.metrics[key]) for r, _ in results]
        if key == "policy_loss":
            out[key] = sum(v * scale for v, (_, scale) in zip(values, results, strict=True))
        elif key in ("loss_tokens", "rejected_tokens"):
            out[key] = sum(values)
        elif key.startswith("max_"):
            out[key] = max(values)
        else:
            total = sum(tokens)
            weights = tokens if total > 0 else [1.0] * len(values)
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / max(sum(weights), 1e-300)
    return out


def reduce_and_measure(
    space: GradientSpace,
    grads: list[torch.Tensor | None],
    world_size: int,
    top: int,
    after: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[float, list[dict[str, Any]], dict[str, float]]:
    """Reduce a config's gradients as the trainer does and measure them: (global norm, the `top` parameters' norms,
    every parameter's norm); `after` sees the reduced gradients."""
    reduced = space.reduce(grads, world_size)
    norm, norms = space.norms(reduced)
    top_params = [{"name": n, "grad_norm": v} for n, v in sorted(norms.items(), key=lambda kv: -kv[1])[:top]]
    if after is not None:
        after(reduced)
    return norm, top_params, norms


def _probe(
    model: nn.Module,
    space: GradientSpace,
    inputs: RankInputs,
    baseline: AppliedConfig,
    masks: dict[int, torch.Tensor] | None,
    job: WorkerJob,
    cancel: threading.Event | None = None,
) -> tuple[float, list[torch.Tensor]]:
    """The reduced gradient of `baseline` (the clean reference's config) with the `masks`' tokens left out of the
    loss (None: none): (grad norm, gradient)."""
    samples = SampleFilter(tokens=TokenDrop(masks)) if masks is not None else baseline.samples
    cfg = dataclasses.replace(baseline, config_id="clean", samples=samples)
    counts = {"clean": step_counts(inputs, cfg, baseline.loss, job.counts, job.world_size)}
    grads, _ = forward_group(model, space, inputs, [cfg], counts=counts, cancel=cancel)
    kept = _Kept()
    norm, _, _ = reduce_and_measure(space, grads["clean"], job.world_size, 0, kept)
    return norm, kept.grads


def own_baseline_figures(grad_norm: float, bar: SpikeBar | None, baseline_cosine: float | None) -> dict[str, Any]:
    """The clean gradient's figures when nothing is left out: the baseline is under the bar, or there is no bar."""
    return {
        "left_out": [],
        "wholly_left_out": [],
        "tokens_left_out": 0,
        "share_left_out": 0.0,
        "reached": bar is not None,
        "reason": None if bar is not None else "no spike bar: the snapshot has no usable median norm",
        "bar": None if bar is None else bar.value,
        "grad_norm": grad_norm if bar is not None else None,
        "ratio_to_median": grad_norm / bar.median_norm if bar is not None else None,
        "baseline_cosine": baseline_cosine if bar is not None else None,
        "passes": 0,
    }


def _own_baseline(
    space: GradientSpace, g: list[torch.Tensor], grad_norm: float, bar: SpikeBar | None
) -> dict[str, Any]:
    """`own_baseline_figures` with the baseline's cosine to itself in this gradient space."""
    return own_baseline_figures(grad_norm, bar, space.cosine(g, g) if bar is not None else None)


def clean_gradient(
    model: nn.Module,
    space: GradientSpace,
    inputs: RankInputs,
    baseline: AppliedConfig,
    figures: _Figures,
    g: list[torch.Tensor],
    grad_norm: float,
    job: WorkerJob,
    cancel: threading.Event | None = None,
) -> None:
    """The clean gradient (see `replay.compute.clean_gradient`) of the baseline gradient `g`, into `figures`: rank the
    loss tokens by the baseline loss's pull on them, then search for how few of the top ones to leave out (one forward
    + backward per probe) for the gradient to be under the spike bar. A collective: every process calls it and
    takes the same decisions (each sees the same order and the same reduced norms)."""
    bar = job.spike_bar
    if bar is None or not bar.is_spike(grad_norm):
        figures.clean = g if bar is not None else None
        figures.info = _own_baseline(space, g, grad_norm, bar)
        return
    reference, recomputed = on_policy(baseline)
    if recomputed:  # first the on-policy gradient: no stored log-prob signal left in it
        check_cancel(cancel, "replay")
        norm0, grads0 = _probe(model, space, inputs, reference, None, job, cancel)
        if not bar.is_spike(norm0):
            figures.clean = grads0
            figures.info = {
                **_own_baseline(space, grads0, norm0, bar),
                "recomputed": list(recomputed),
                "baseline_cosine": space.cosine(g, grads0),
                "passes": 1,
            }
            return
    pulls, masks = {}, {}
    own = {rank: (figures.grad_logprobs[rank].cpu(), figures.traces[rank].mask.cpu()) for rank in inputs.batches}
    for part in gather_objects(own):
        for rank, (pull, mask) in part.items():
            pulls[rank], masks[rank] = pull, mask
    order = token_order(pulls, masks)
    shapes = {rank: batch["loss_mask"].shape for rank, batch in inputs.batches.items()}
    found: dict[int, tuple[float, list[torch.Tensor]]] = {}
    norms: dict[int, float] = {}

    def under(count: int) -> bool:
        check_cancel(cancel, "replay")
        norm, grads = _probe(model, space, inputs, reference, order.masks(count, shapes, inputs.device), job, cancel)
        norms[count] = norm
        below = not bar.is_spike(norm)
        if below or count == order.cap:  # the search only moves down from a probe under the bar: keep the last
            found.clear()
            found[count] = (norm, grads)
        return below

    count, reached = smallest_count(under, order.cap)
    clean_norm, clean = found.get(count, (grad_norm, g))
    figures.clean = clean
    figures.info = {
        **order.summary(count),
        "reached": reached,
        "reason": None if reached else not_reached_reason(order, clean_norm, bar),
        "bar": bar.value,
        "grad_norm": clean_norm,
        "ratio_to_median": clean_norm / bar.median_norm,
        "baseline_cosine": space.cosine(g, clean),
        "passes": len(norms) + bool(recomputed),
        "probe_norms": {str(k): v for k, v in sorted(norms.items())},  # tokens left out -> grad norm
        "recomputed": list(recomputed),
    }


ModelSource = Callable[[ModelSpec, str, str, Placement], nn.Module]  # (config, weights dir, device, placement)


def _held(model: nn.Module, job: WorkerJob) -> str:
    """What this process holds of the model, for the progress line."""
    if not job.shard:
        return ""
    from torch.distributed.tensor import DTensor

    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    return f" (sharded: {local:,} of {whole:,} parameters here)"


def on_policy(baseline: AppliedConfig) -> tuple[AppliedConfig, tuple[str, ...]]:
    """The clean reference's config: the baseline with its stored old and rollout log-probs recomputed as the
    forward's own (every ratio and IS weight 1, as at the step's first update with sound signals), and the names
    recomputed; the baseline itself when the loss cannot take them (rejection sampling under normalization
    global counts its tokens before the forward)."""
    loss = baseline.loss
    if loss.normalization == "global" and (loss.rollout_rs or loss.ratio_outlier_mask):
        return baseline, ()
    names = ("old_logprobs", "rollout_logprobs")
    items = frozenset((name, None, None) for name in names) | baseline.recompute.items
    return dataclasses.replace(baseline, recompute=Recompute(items)), names


def compute(
    job: WorkerJob,
    process: int,
    cancel: threading.Event | None = None,
    *,
    models: ModelSource | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[ConfigOutcome]:
    """Replay every config of `job` on this process's saved ranks; outcomes in the configs' order.

    `cancel` (in-process runs only; spawned processes are stopped by their launcher) is checked between configs,
    and before each micro-batch's pass where this process computes alone (`within_config`). `models` builds the
    policy (default `build_model`; a warm pool passes its weight cache); `progress` gets a line after loading and
    after each config.
    """
    say = progress or (lambda line: None)
    start = time.perf_counter()
    inputs = RankInputs(job.replay_dir, job.assignment[process], job.device, routing_shape(job.model))
    for rank, batch in inputs.batches.items():  # a rank every config leaves out: token ids it cannot embed blanked
        if not any(cfg.samples.keeps_rank(rank) for cfg in job.configs) and blank_tokens(batch, job.model):
            say(
                f"process {process}: rank {rank} is left out by every config; its token ids outside the vocabulary "
                "blanked"
            )
    outcomes = {cfg.config_id: ConfigOutcome(cfg.config_id) for cfg in job.configs}
    load_s = time.perf_counter() - start
    say(f"process {process}: loaded {len(inputs.batches)} rank batch(es) in {load_s:.2f} s")
    baseline = job.configs[0]  # the engine puts the baseline (the saved loss) first
    counts = {cfg.config_id: step_counts(inputs, cfg, baseline.loss, job.counts, job.world_size) for cfg in job.configs}
    # the outcome figures (footprint, the clean gradient) are a mitigation's: a hypothesis is judged by the record
    fixes = [cfg for cfg in job.configs[1:] if cfg.mitigations and not cfg.is_hypothesis]
    figures = _Figures() if fixes and not baseline.mitigations else None
    model, weights = None, object()
    space: GradientSpace | None = None
    for group in forward_groups(job.configs):
        check_cancel(cancel, "replay")
        t0 = time.perf_counter()
        if group[0].weights != weights or model is None or space is None:
            weights = group[0].weights
            model = (models or build_model)(job.model, weights or job.replay_dir, job.device, job.placement)
            space = gradient_space(model, job)
            load_s += time.perf_counter() - t0
            say(f"process {process}: weights ready in {time.perf_counter() - t0:.2f} s" + _held(model, job))
        t1 = time.perf_counter()
        for rep in range(job.repeat):
            traced = figures if rep == 0 else None
            local_norms: dict[int, dict[str, float]] = {}
            grads, metrics = forward_group(
                model, space, inputs, group, traced, counts, local_norms if rep == 0 else None, cancel
            )
            for cfg in group:
                check_cancel(cancel, "replay")
                outcome = outcomes[cfg.config_id]
                mitigated = bool(cfg.mitigations) and not cfg.is_hypothesis  # a hypothesis is judged by the record
                kept = _Kept() if traced is not None and (cfg is baseline or mitigated) else None
                norm, top_params, norms = reduce_and_measure(space, grads[cfg.config_id], job.world_size, job.top, kept)
                grads[cfg.config_id] = []  # this config's gradient is measured: free it before the next
                if rep == 0 and cfg.config_id == "baseline" and not cfg.mitigations:  # a collective: every process
                    outcome.param_grad_norms = norms
                    parts = gather_objects(local_norms)
                    outcome.rank_param_grad_norms = {r: n for part in parts for r, n in part.items()}
                if kept is not None and cfg is baseline:
                    assert traced is not None
                    t2 = time.perf_counter()
                    clean_gradient(model, space, inputs, baseline, traced, kept.grads, norm, job, cancel)
                    traced.seconds = time.perf_counter() - t2
                elif kept is not None and traced is not None and traced.clean is not None:
                    outcome.cosine_to_clean = space.cosine(kept.grads, traced.clean)
                outcome.grad_norms.append(norm)
                if rep == 0:
                    outcome.top_params = top_params
                    gathered = gather_objects(metrics[cfg.config_id])
                    rows = sorted((m for part in gathered for m in part), key=lambda m: m["rank"])
                    parts = [m.pop("_footprint") for m in rows if "_footprint" in m]
                    if parts:
                        outcome.footprint = merge_footprint(parts)
                    if traced is not None and mitigated:
                        outcome.clean_gradient = traced.info
                        outcome.timings["clean_gradient"] = traced.seconds
                    outcome.rank_metrics = rows
        per_config = (time.perf_counter() - t1) / len(group)
        for cfg in group:
            outcomes[cfg.config_id].timings["compute"] = per_config
            say(f"process {process}: {cfg.config_id} computed (grad norm {outcomes[cfg.config_id].grad_norms[0]:.6g})")
    for outcome in outcomes.values():
        outcome.timings["load"] = load_s
    return [outcomes[cfg.config_id] for cfg in job.configs]
