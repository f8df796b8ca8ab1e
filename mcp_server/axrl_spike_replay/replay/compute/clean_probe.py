"""The clean gradient of a spiking baseline, searched by probes (`replay.compute.clean_gradient` ranks the tokens):
each probe is the baseline's gradient with the top tokens left out of the loss, one forward and backward."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.mitigation.recompute import Recompute
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.compute.clean_gradient import SpikeBar, not_reached_reason, smallest_count, token_order
from axrl_spike_replay.replay.compute.gradient_space import GradientSpace
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, step_counts
from axrl_spike_replay.replay.compute.rank_passes import (
    KeptGradients,
    StepFigures,
    forward_group,
    gather_objects,
    reduce_and_measure,
)
from axrl_spike_replay.replay.compute.worker_job import WorkerJob
from axrl_spike_replay.training.sample_masks import SampleFilter, TokenDrop

if TYPE_CHECKING:
    from axrl_spike_replay.replay.compute.worker_job import WorkerJob


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
    kept = KeptGradients()
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
    figures: StepFigures,
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
