"""A replay job computed streamed, in this process: every saved rank, one decoder layer at a time.

`run_streamed_job` is a `launch.JobRunner`: the engine judges and records its outcomes as it does the whole or
sharded replay's (`ReplaySession.result`). For each forward group (`process_inputs.forward_groups`: configs sharing
weights and routing) the forward runs once (`layer_passes.forward_layers`) and each config its own backward
(`layer_passes.backward_steps`); a config's outcome holds its grad norm, top parameters, each rank's metrics, the
baseline's per-parameter norms of the reduced gradient and of each saved rank's own gradient, and a mitigated
config's footprint against the baseline. Boundaries live in a `BoundaryStore`, whose spill dir is removed however the
job ends (cancelled, timed out, failed).

With mitigations, the clean gradient is searched on the baseline's forward after the baseline's backward, and the
mitigated configs' backwards run beside one clean backward for their cosines to clean (`clean_reference`: all of a
forward group's at once where the host memory left holds their gradient boundaries, `configs_beside`, each layer
read once for all of them); the baseline's forward boundaries and its embedding and head are then held until the
job ends.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.models.policy import routing_shape
from axrl_spike_replay.processes.rank_processes import RunCancelled, check_cancel
from axrl_spike_replay.replay.compute.host_allocator import return_freed_host_memory
from axrl_spike_replay.replay.compute.outcome_figures import RankTrace, footprint_counts, merge_footprint
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, forward_groups, step_counts
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.jobs.job_runner import prepare_device
from axrl_spike_replay.replay.streamed.boundaries import boundary_store
from axrl_spike_replay.replay.streamed.clean_reference import (
    CleanReference,
    Forward,
    Step,
    clean_reference,
    configs_beside,
)
from axrl_spike_replay.replay.streamed.expert_share import ExpertShare
from axrl_spike_replay.replay.streamed.layer_passes import ConfigPass, forward_layers, stream_items
from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights
from axrl_spike_replay.replay.streamed.piece_dots import together
from axrl_spike_replay.replay.streamed.rank_chain import RankChain
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.training.loss_normalization import GlobalCounts


class _Deadline(threading.Event):
    """`cancel`, or the job's time limit passed (which raises), checked between layers and micro-batches."""

    def __init__(self, cancel: threading.Event | None, timeout_s: float) -> None:
        super().__init__()
        self.cancel, self.until, self.timeout_s = cancel, time.monotonic() + timeout_s, timeout_s

    def is_set(self) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            return True
        if time.monotonic() > self.until:
            raise RunCancelled(f"replay timed out after {self.timeout_s:g} s (streamed)")
        return False


def compute_streamed(
    job: WorkerJob,
    cancel: threading.Event | None = None,
    progress: Callable[[str], None] | None = None,
    settings: StreamSettings | None = None,
    timeout_s: float = float("inf"),
    chain: RankChain | None = None,
    share: ExpertShare | None = None,
) -> list[ConfigOutcome]:
    """Every config of `job` over every saved rank, streamed; outcomes in the configs' order (`chain`: this process
    streams the saved ranks of `job.assignment` only, one process of a chain, `streamed_processes`; `share`: this
    process holds its block of each MoE layer's experts, `expert_share`).

    Computed on one intra-op thread with deterministic algorithms, as every replay process computes
    (`job_runner.run_job`): the same reductions as the whole replay's, bit for bit, and no thread pool
    oversubscribing a shared host; the setting is the caller's again after."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    if job.device.startswith("cuda"):  # deterministic cuBLAS, as `launch.run_job` sets for its processes
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(1)
    try:
        prepare_device(job.device)
        return _compute(job, cancel, progress, settings, timeout_s, chain, share)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _compute(
    job: WorkerJob,
    cancel: threading.Event | None,
    progress: Callable[[str], None] | None,
    settings: StreamSettings | None,
    timeout_s: float,
    chain: RankChain | None = None,
    share: ExpertShare | None = None,
) -> list[ConfigOutcome]:
    settings = settings or StreamSettings()
    return_freed_host_memory()  # freed layers go back to the system, not kept under a rising mmap threshold
    say = progress or (lambda line: None)
    stop = _Deadline(cancel, timeout_s)
    start = time.perf_counter()
    ranks = sorted(r for ranks in job.assignment for r in ranks)
    inputs = RankInputs(job.replay_dir, ranks, job.device, routing_shape(job.model))
    outcomes = {cfg.config_id: ConfigOutcome(cfg.config_id) for cfg in job.configs}
    baseline = job.configs[0]
    counts = {cfg.config_id: step_counts(inputs, cfg, baseline.loss, job.counts, job.world_size) for cfg in job.configs}
    recorded = job.precision is not None and job.precision.recorded
    reduce_dtype = job.precision.torch_dtype("reduce_dtype") if recorded and job.precision else None
    base_traces: dict[int, RankTrace] = {}
    # the outcome figures (footprint, the clean gradient) are a mitigation's: a hypothesis is judged by the record
    fixes = [cfg for cfg in job.configs[1:] if cfg.mitigations and not cfg.is_hypothesis]
    wants_clean = bool(fixes) and not baseline.mitigations
    step = Step(inputs, job.world_size, reduce_dtype, stop, chain)
    clean: CleanReference | None = None
    say(f"streamed: {len(ranks)} saved rank(s) in this process, one decoder layer at a time")
    with contextlib.ExitStack() as held:  # the baseline's forward, while the clean gradient is recomputed from it
        for group in forward_groups(job.configs):
            check_cancel(stop, "replay")
            t0 = time.perf_counter()
            weights = StreamedWeights(
                job.model, group[0].weights or job.replay_dir, job.device, job.precision, settings.read_ahead, share
            )
            if share is not None:
                mine, whole = weights.expert_bytes()
                say(f"streamed: this process holds {mine:,} of {whole:,} bytes of the MoE layers' expert weights")
            with contextlib.ExitStack() as own:
                keep = held if wants_clean and group[0] is baseline else own
                keep.callback(weights.close)
                weights.check()
                weights.load_ends()
                items = stream_items(inputs, group)
                need_entropy = any(cfg.needs_entropy for cfg in group)
                store = keep.enter_context(boundary_store(settings.host_budget_bytes, settings.spill_dir, job.device))
                forward = Forward(weights, items, store, need_entropy)
                forward_layers(weights, items, store, stop, say)
                order = [name for name, _ in weights.policy.named_parameters()]
                beside: dict[str, tuple[ConfigPass, float | None]] = {}  # taken beside the clean one, together
                for rep in range(job.repeat):
                    for at, cfg in enumerate(group):
                        outcome = outcomes[cfg.config_id]
                        own_norms = rep == 0 and cfg.config_id == "baseline" and not cfg.mitigations
                        mitigated = bool(cfg.mitigations) and not cfg.is_hypothesis
                        pulls: dict[int, list[torch.Tensor]] | None = {} if own_norms and wants_clean else None
                        cosine = None
                        if rep == 0 and mitigated and clean is not None:
                            if cfg.config_id not in beside:
                                beside.update(_beside(step, forward, clean, group[at:], counts))
                            done, cosine = beside.pop(cfg.config_id)
                        else:
                            (done,) = together(
                                [step.steps(forward, cfg, counts[cfg.config_id], keep_own=own_norms, pulls=pulls)]
                            )
                        norm = done.figures.grad_norm(order)
                        outcome.grad_norms.append(norm)
                        if rep:
                            continue
                        ranked = sorted(done.figures.norms.items(), key=lambda kv: -kv[1])[: job.top]
                        outcome.top_params = [{"name": n, "grad_norm": v} for n, v in ranked]
                        outcome.rank_metrics = done.rank_metrics
                        if own_norms:
                            outcome.param_grad_norms = dict(done.figures.norms)
                            outcome.rank_param_grad_norms = done.figures.rank_norms
                            base_traces = done.traces
                            if pulls is not None:
                                counts_of = partial(_counts, inputs, job)
                                clean = clean_reference(step, forward, baseline, counts_of, done, pulls, job.spike_bar)
                                say(f"streamed: clean gradient made in {clean.seconds:.2f} s")
                        elif mitigated and base_traces:
                            parts = [
                                footprint_counts(base_traces[r], t) for r, t in done.traces.items() if r in base_traces
                            ]
                            outcome.footprint = merge_footprint(parts) if parts else None
                        if mitigated and clean is not None:
                            outcome.cosine_to_clean = cosine
                            outcome.clean_gradient = clean.info
                            outcome.timings["clean_gradient"] = clean.seconds
                        say(f"streamed: {cfg.config_id} computed (grad norm {norm:.6g})")
                say(
                    f"streamed: boundaries held {store.figures.peak_memory:,} bytes in memory at most, "
                    f"{store.figures.peak_disk:,} on disk ({store.figures.spilled} spilled)"
                )
            per_config = (time.perf_counter() - t0) / len(group)
            for cfg in group:
                outcomes[cfg.config_id].timings["compute"] = per_config
                outcomes[cfg.config_id].timings["load"] = weights.read.seconds
                outcomes[cfg.config_id].timings["read_wait"] = weights.read.waited
            say(
                f"streamed: read {weights.read.bytes_read:,} bytes of weights ({weights.read.layer_reads} layer "
                f"reads, {weights.read.seconds:.2f} s reading, {weights.read.waited:.2f} s of it waited for)"
            )
    say(f"streamed: {time.perf_counter() - start:.2f} s in all")
    return [outcomes[cfg.config_id] for cfg in job.configs]


def _beside(
    step: Step,
    forward: Forward,
    clean: CleanReference,
    rest: list[AppliedConfig],
    counts: dict[str, GlobalCounts | None],
) -> dict[str, tuple[ConfigPass, float | None]]:
    """The mitigated configs from the start of `rest`, as many as go beside one clean backward (`configs_beside`):
    each one's pass and cosine to clean, by config id."""
    wanted = [cfg for cfg in rest if cfg.mitigations and not cfg.is_hypothesis]
    taken = wanted[: configs_beside(step, forward, len(wanted))]
    passes = clean.beside_all(step, forward, [(cfg, counts[cfg.config_id]) for cfg in taken])
    return {cfg.config_id: done for cfg, done in zip(taken, passes, strict=True)}


def _counts(inputs: RankInputs, job: WorkerJob, cfg: AppliedConfig) -> GlobalCounts | None:
    """The global counts `cfg` normalises by (a probe of the clean gradient's: counted as the whole replay's)."""
    return step_counts(inputs, cfg, job.configs[0].loss, job.counts, job.world_size)


def run_streamed_job(
    job: WorkerJob,
    timeout_s: float = RUN_TIMEOUT_S,
    cancel: threading.Event | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    slot: int = 0,
    settings: StreamSettings | None = None,
) -> list[ConfigOutcome]:
    """`launch.JobRunner` for a streamed replay: the job computed here, in this process."""
    del slot  # one process: no pools
    return compute_streamed(job, cancel, progress, settings, timeout_s)
