"""One replay process: load weights and its saved ranks' batches, recompute gradients per config, reduce.

Configs that differ only in the loss share one forward pass per rank batch: the loss of each config
is backpropagated from the same graph (`retain_graph`) into its own gradient buffers. Reduction and
norms use `training.rank_step` exactly as the trainer does, so the baseline reproduces training.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch import nn

from axrl_spike_replay.models.policy import ModelSpec, routing_shape
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.compute.clean_probe import clean_gradient
from axrl_spike_replay.replay.compute.gradient_space import GradientSpace, Sharded, Whole
from axrl_spike_replay.replay.compute.model_build import Placement, build_model
from axrl_spike_replay.replay.compute.outcome_figures import merge_footprint
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, forward_groups, step_counts
from axrl_spike_replay.replay.compute.rank_passes import (
    KeptGradients,
    StepFigures,
    forward_group,
    gather_objects,
    reduce_and_measure,
)
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.reading.input_checks import blank_tokens


def gradient_space(model: nn.Module, job: WorkerJob) -> GradientSpace:
    """How this process's gradients are taken and reduced for `job` (whole or sharded; see `gradient_space`)."""
    if job.shard:
        return Sharded(model, max(len(ranks) for ranks in job.assignment))
    recorded = job.precision is not None and job.precision.recorded
    return Whole(model, job.precision.torch_dtype("reduce_dtype") if recorded and job.precision else None)


ModelSource = Callable[[ModelSpec, str, str, Placement], nn.Module]  # (config, weights dir, device, placement)


def _held(model: nn.Module, job: WorkerJob) -> str:
    """What this process holds of the model, for the progress line."""
    if not job.shard:
        return ""
    from torch.distributed.tensor import DTensor

    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    return f" (sharded: {local:,} of {whole:,} parameters here)"


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
    figures = StepFigures() if fixes and not baseline.mitigations else None
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
                kept = KeptGradients() if traced is not None and (cfg is baseline or mitigated) else None
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
