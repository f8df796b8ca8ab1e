"""A replay job computed streamed, in this process: every saved rank, one decoder layer at a time.

`run_streamed_job` is a `launch.JobRunner`: the engine judges and records its outcomes as it does the whole or
sharded replay's (`ReplaySession.result`). For each forward group (`worker.forward_groups`: configs sharing weights and
routing) the forward runs once (`layer_passes.forward_layers`) and each config its own backward
(`layer_passes.backward_config`); a config's outcome holds its grad norm, top parameters, each rank's metrics, the
baseline's per-parameter norms of the reduced gradient and of each saved rank's own gradient, and a mitigated
config's footprint against the baseline. Boundaries live in a `BoundaryStore`, whose spill dir is removed however
the job ends (cancelled, timed out, failed).

Not computed streamed (said in the progress log): the clean gradient and cosine to clean.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from axrl_spike_replay.models.policy import routing_shape
from axrl_spike_replay.rank_processes import RunCancelled, check_cancel
from axrl_spike_replay.replay.host_allocator import return_freed_host_memory
from axrl_spike_replay.replay.job_runner import prepare_device
from axrl_spike_replay.replay.outcome_figures import RankTrace, footprint_counts, merge_footprint
from axrl_spike_replay.replay.streamed.boundaries import boundary_store
from axrl_spike_replay.replay.streamed.layer_passes import backward_config, forward_layers, stream_items
from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights
from axrl_spike_replay.replay.streamed.rank_chain import RankChain
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.replay.worker import ConfigOutcome, RankInputs, WorkerJob, forward_groups, step_counts


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
) -> list[ConfigOutcome]:
    """Every config of `job` over every saved rank, streamed; outcomes in the configs' order (`chain`: this process
    streams the saved ranks of `job.assignment` only, one process of a chain, `streamed_processes`).

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
        return _compute(job, cancel, progress, settings, timeout_s, chain)
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
    say(f"streamed: {len(ranks)} saved rank(s) in this process, one decoder layer at a time")
    for group in forward_groups(job.configs):
        check_cancel(stop, "replay")
        t0 = time.perf_counter()
        weights = StreamedWeights(
            job.model, group[0].weights or job.replay_dir, job.device, job.precision, settings.read_ahead
        )
        try:
            weights.check()
            weights.load_ends()
            items = stream_items(inputs, group)
            need_entropy = any(cfg.needs_entropy for cfg in group)
            with boundary_store(settings.host_budget_bytes, settings.spill_dir, job.device) as store:
                forward_layers(weights, items, store, stop, say)
                order = [name for name, _ in weights.policy.named_parameters()]
                for rep in range(job.repeat):
                    for cfg in group:
                        outcome = outcomes[cfg.config_id]
                        own = rep == 0 and cfg.config_id == "baseline" and not cfg.mitigations
                        done = backward_config(
                            weights,
                            items,
                            store,
                            inputs,
                            cfg,
                            counts[cfg.config_id],
                            job.world_size,
                            need_entropy=need_entropy,
                            keep_own=own,
                            reduce_dtype=reduce_dtype,
                            cancel=stop,
                            chain=chain,
                        )
                        norm = done.figures.grad_norm(order)
                        outcome.grad_norms.append(norm)
                        if rep:
                            continue
                        ranked = sorted(done.figures.norms.items(), key=lambda kv: -kv[1])[: job.top]
                        outcome.top_params = [{"name": n, "grad_norm": v} for n, v in ranked]
                        outcome.rank_metrics = done.rank_metrics
                        if own:
                            outcome.param_grad_norms = dict(done.figures.norms)
                            outcome.rank_param_grad_norms = done.figures.rank_norms
                            base_traces = done.traces
                        elif cfg.mitigations and not cfg.is_hypothesis and base_traces:
                            parts = [
                                footprint_counts(base_traces[r], t) for r, t in done.traces.items() if r in base_traces
                            ]
                            outcome.footprint = merge_footprint(parts) if parts else None
                        say(f"streamed: {cfg.config_id} computed (grad norm {norm:.6g})")
                say(
                    f"streamed: boundaries held {store.figures.peak_memory:,} bytes in memory at most, "
                    f"{store.figures.peak_disk:,} on disk ({store.figures.spilled} spilled)"
                )
        finally:
            weights.close()
        per_config = (time.perf_counter() - t0) / len(group)
        for cfg in group:
            outcomes[cfg.config_id].timings["compute"] = per_config
            outcomes[cfg.config_id].timings["load"] = weights.read.seconds
            outcomes[cfg.config_id].timings["read_wait"] = weights.read.waited
        say(
            f"streamed: read {weights.read.bytes_read:,} bytes of weights ({weights.read.layer_reads} layer reads, "
            f"{weights.read.seconds:.2f} s reading, {weights.read.waited:.2f} s of it waited for)"
        )
    if any(cfg.mitigations and not cfg.is_hypothesis for cfg in job.configs[1:]):
        say("streamed: the clean gradient and cosine to clean are not computed by a streamed replay")
    say(f"streamed: {time.perf_counter() - start:.2f} s in all")
    return [outcomes[cfg.config_id] for cfg in job.configs]


def run_streamed_job(
    job: WorkerJob,
    timeout_s: float = 1800.0,
    cancel: threading.Event | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    slot: int = 0,
    settings: StreamSettings | None = None,
) -> list[ConfigOutcome]:
    """`launch.JobRunner` for a streamed replay: the job computed here, in this process."""
    del slot  # one process: no pools
    return compute_streamed(job, cancel, progress, settings, timeout_s)
