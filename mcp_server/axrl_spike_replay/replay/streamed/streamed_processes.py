"""A streamed replay split over several processes (CPU: gloo; CUDA: one GPU each, NCCL): each streams a contiguous
block of the saved ranks layer by layer, the pieces' gradient sums chained across them (`rank_chain`), so the step's
figures are the one-process streamed replay's, bit for bit.

Each process reads every layer itself (the checkpoint is read once per process per pass) and holds its own
ranks' boundaries; the last process measures every piece. At the end every process hands its outcomes to the last,
which merges them: the step's figures (grad norm, per-parameter norms, top parameters) are its own, each rank's
metrics and own per-parameter norms come from the process that streamed that rank, a mitigated config's footprint
is the sum of every process's counts. The last process writes the merged outcomes for the caller.

Or (`experts`: where one MoE layer with its gradient does not fit one device, as the plan's streamed row chooses,
`expert_plan`) each layer's routed experts split over
the processes (`expert_share`): every process streams every saved rank, reads and holds only its block of each MoE
layer's experts and computes the rest of the layer itself; the routed outputs are all-reduced in the forward, the
input gradients from each process's experts in the backward, and the step's figures put together from every
process's after each backward, so every process holds them and the last writes its outcomes. No all-to-all: every
process sees every token, and the exchange per MoE layer and micro-batch is one all-reduce of the block's output
forward and two (its input's and the routing weights' gradients) backward. The figures are the one process's to
rounding (1e-6), not bit for bit: the experts' input gradients are summed in another order, and a split weight's
norms are float64 ones. Built for tiny_moe, qwen2_moe and qwen3_moe; another architecture or a Megatron checkpoint
is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.experiment.result import FOOTPRINT_COUNTS, Footprint
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.replay.streamed.expert_share import ExpertShare, check_expert_split
from axrl_spike_replay.replay.streamed.rank_chain import RankChain, contiguous_blocks
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed, run_streamed_job

_OUTCOMES = "outcomes.json"


def merge_outcomes(parts: list[list[ConfigOutcome]]) -> list[ConfigOutcome]:
    """Every process's outcomes (in process order) as one: the step's figures from the last process, each saved
    rank's from its own process, footprint counts summed."""
    merged = []
    for by_process in zip(*parts, strict=True):
        last = by_process[-1]
        rows = sorted((row for o in by_process for row in o.rank_metrics), key=lambda row: int(row["rank"]))
        own: dict[int, dict[str, float]] = {}
        for o in by_process:
            own.update(o.rank_param_grad_norms or {})
        footprint = None
        prints = [_counts(o.footprint) for o in by_process if o.footprint is not None]
        if prints:
            footprint = Footprint.of_counts({k: sum(p[k] for p in prints) for k in FOOTPRINT_COUNTS})
        merged.append(
            dataclasses.replace(
                last,
                rank_metrics=rows,
                rank_param_grad_norms=own if last.param_grad_norms is not None else None,
                footprint=footprint,
            )
        )
    return merged


def _counts(footprint: Footprint) -> dict[str, int]:
    return {k: int(getattr(footprint, k)) for k in FOOTPRINT_COUNTS}


def run_streamed_processes(
    job: WorkerJob,
    processes: int,
    settings: StreamSettings | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
    cancel: threading.Event | None = None,
    progress: Callable[[str], None] | None = None,
    experts: bool = False,
) -> list[ConfigOutcome]:
    """`job` streamed by `processes` spawned processes, each a block of the saved ranks, or (`experts`) each every
    saved rank with its block of each MoE layer's experts (see the module docstring)."""
    from axrl_spike_replay.files.temp_janitor import owned_temp_dir
    from axrl_spike_replay.processes.process_starts import rank_context
    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.replay.jobs.job_runner import backend_for

    ranks = sorted(r for block in job.assignment for r in block)
    if experts:
        check_expert_split(job.model, processes)
        blocks: list[tuple[int, ...]] | None = None
    elif not 1 <= processes <= len(ranks):
        raise ConfigError(
            f"`nproc`: a streamed replay splits the {len(ranks)} saved ranks over 1 to {len(ranks)} processes, "
            f"not {processes}",
            "nproc",
        )
    else:
        blocks = contiguous_blocks(ranks, processes)
    lines = rank_context().SimpleQueue() if progress is not None else None
    relay = None
    if lines is not None and progress is not None:
        relay = threading.Thread(target=_relay, args=(lines, progress), name="streamed-progress", daemon=True)
        relay.start()
    with owned_temp_dir("axrl-streamed-") as tmp:
        path = str(Path(tmp) / _OUTCOMES)
        try:
            spawn_ranks(
                _process,
                processes,
                (job, blocks, settings, path, lines, timeout_s),
                backend=backend_for(job.device, processes),
                timeout_s=timeout_s,
                prepare=_prepare,
                label="streamed replay",
                cancel=cancel,
                native_crash_retries=1,  # a replay only reads the snapshot: rerunning it is safe
            )
        finally:
            if lines is not None and relay is not None:
                lines.put(None)
                relay.join(timeout=5.0)
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    return [outcome_of(item) for item in doc]


def outcome_of(item: dict[str, Any]) -> ConfigOutcome:
    """A config's outcome read back from JSON (its footprint a `Footprint` again)."""
    footprint = item.get("footprint")
    return ConfigOutcome(**{**item, "footprint": Footprint(**footprint) if isinstance(footprint, dict) else None})


def _relay(lines: Any, progress: Callable[[str], None]) -> None:
    while True:
        line = lines.get()
        if line is None:
            return
        progress(line)


def _prepare(process: int, payload: tuple[Any, ...]) -> None:
    from axrl_spike_replay.replay.jobs.job_runner import prepare_device, process_device

    prepare_device(process_device(payload[0].device, process))


def _process(process: int, processes: int, payload: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    from axrl_spike_replay.files.atomic import atomic_write_json
    from axrl_spike_replay.replay.jobs.job_runner import process_device

    job, blocks, settings, path, lines, timeout_s = payload
    device = process_device(job.device, process)
    say = None if lines is None else (lambda line: lines.put(f"process {process}: {line}"))
    if blocks is None:  # every saved rank here, this process's block of each MoE layer's experts
        local = dataclasses.replace(job, device=device)
        share = ExpertShare(process, processes)
        outcomes = compute_streamed(local, progress=say, settings=settings, timeout_s=timeout_s, share=share)
        if process == processes - 1:  # every process holds the step's figures, put together (`expert_share`)
            atomic_write_json(path, [asdict(o) for o in outcomes])
        dist.barrier()
        return
    local = dataclasses.replace(job, assignment=(blocks[process],), device=device)
    chain = RankChain(process, processes, device)
    # each process stops itself past the limit too (between layers, its spill dir removed as it ends)
    outcomes = compute_streamed(local, progress=say, settings=settings, timeout_s=timeout_s, chain=chain)
    gathered: list[Any] = [None] * processes
    dist.all_gather_object(gathered, [asdict(o) for o in outcomes])
    if process == processes - 1:
        parts = [[outcome_of(item) for item in part] for part in gathered]
        atomic_write_json(path, [asdict(o) for o in merge_outcomes(parts)])
    dist.barrier()


def streamed_runner(settings: StreamSettings | None, processes: int = 1, experts: bool = False) -> JobRunner:
    """The engine's runner of a streamed job with these boundary settings: `run_streamed_job` in this process, or
    `run_streamed_processes` over `processes` spawned ones when more than one (`experts`: each MoE layer's experts
    split over them, not the saved ranks)."""

    def run(
        job: WorkerJob,
        timeout_s: float = RUN_TIMEOUT_S,
        cancel: threading.Event | None = None,
        *,
        progress: Callable[[str], None] | None = None,
        slot: int = 0,
    ) -> list[ConfigOutcome]:
        if processes > 1:
            return run_streamed_processes(job, processes, settings, timeout_s, cancel, progress, experts)
        return run_streamed_job(job, timeout_s, cancel, progress=progress, slot=slot, settings=settings)

    return run
