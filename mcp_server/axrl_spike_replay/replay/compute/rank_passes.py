"""A forward group replayed over a process's saved ranks, micro-batch by micro-batch as the trainer ran the step:
one forward per micro-batch serves every config of the group, each config's loss is backpropagated into its own
gradient; then the reduction and the norms, as the trainer takes them (`training.rank_step`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.models.policy import policy_forward
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.compute.gradient_space import GradientSpace, accumulate, padded_passes
from axrl_spike_replay.replay.compute.outcome_figures import RankTrace, footprint_counts
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, config_loss, loss_batch
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.micro_batches import MicroBatch, stitch, take, take_routing
from axrl_spike_replay.training.policy_loss import LossOutput
from axrl_spike_replay.training.rank_step import gradient_norms


@dataclass
class StepFigures:
    """What the outcome figures need across groups: the baseline's per-rank traces, then the clean gradient."""

    traces: dict[int, RankTrace] = field(default_factory=dict)  # baseline, per saved rank
    grad_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)  # baseline dLoss_r/dlogprobs [B, T]
    clean: list[torch.Tensor] | None = None
    info: dict[str, Any] | None = None
    seconds: float = 0.0  # spent on the clean gradient (the configs' `timings.clean_gradient`)


class KeptGradients:
    """Keeps the reduced gradients `reduce_and_measure` hands it (this process's shards, when sharded)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def __call__(self, grads: list[torch.Tensor]) -> None:
        self.grads = [g.detach() for g in grads]


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj`, in process order (`[obj]` in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def forward_group(
    model: nn.Module,
    space: GradientSpace,
    inputs: RankInputs,
    group: Sequence[AppliedConfig],
    figures: StepFigures | None = None,
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
        figures: StepFigures | None,
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
