"""Run a replay job: one process per replay rank with torch.distributed, or in this process for one.

Processes come from `process_starts` (forked from a server that imported torch once, else spawned) and meet
over a FileStore in a private temp dir (gloo on CPU; nccl on CUDA when every process has its own GPU, else
gloo). They die with this process and the temp dirs go even if it is killed (see `rank_processes`). Each runs with one
intra-op thread, as the reference trainer's ranks do, so reductions are deterministic.
"""

from __future__ import annotations

import json
import os
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.files.temp_janitor import owned_temp_dir
from axrl_spike_replay.processes.rank_processes import RankProcessError, spawn_ranks
from axrl_spike_replay.replay.compute.worker import ModelSource, compute
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob

_OUTCOMES = "outcomes.json"


class JobRunner(Protocol):
    """Runs a WorkerJob and returns its outcomes (`job_runner.run_job`, `warm_pool.WarmService.run_job`)."""

    def __call__(
        self,
        job: WorkerJob,
        timeout_s: float = ...,
        cancel: threading.Event | None = ...,
        *,
        progress: Callable[[str], None] | None = ...,
        slot: int = ...,  # which of several pools of one layout (a sweep running configs in parallel)
    ) -> list[ConfigOutcome]: ...


def process_device(device: str, process: int) -> str:
    """The device replay process `process` computes on (a pool in slot `s` of `n` processes counts from `s*n`)."""
    import torch

    if device == "cuda":
        return f"cuda:{process % max(torch.cuda.device_count(), 1)}"
    return device


def backend_for(device: str, nproc: int) -> str:
    """gloo on CPU; nccl on CUDA when there is a GPU per process (nccl needs distinct GPUs), else gloo."""
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() >= nproc:
        return "nccl"
    return "gloo"


def prepare_device(device: str) -> None:
    """Select the GPU of a CUDA device and make its kernels deterministic; nothing on CPU."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)


def run_job(
    job: WorkerJob,
    timeout_s: float = RUN_TIMEOUT_S,
    cancel: threading.Event | None = None,
    *,
    models: ModelSource | None = None,
    progress: Callable[[str], None] | None = None,
    slot: int = 0,
) -> list[ConfigOutcome]:
    """Outcomes of `job` (one per config, process 0's view after the reduction).

    One process in slot 0 runs here, in the calling process (no spawn), unless it shards (FSDP needs a process
    group, even of one); `models` and `progress` apply to it (see `worker.compute`). Otherwise processes are
    spawned for this job and stopped after it; slot `s` (a sweep running configs in parallel) computes on devices
    `s * nproc ...`.
    """
    import torch

    nproc = len(job.assignment)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if nproc == 1 and slot == 0 and not job.shard and not _dist_initialized():
        threads = torch.get_num_threads()
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.set_num_threads(1)
        try:
            local = WorkerJob(**{**_fields(job), "device": process_device(job.device, 0)})
            prepare_device(local.device)
            return compute(local, 0, cancel, models=models, progress=progress)
        except AxrlError:
            raise
        except Exception as exc:
            raise RankProcessError(f"replay failed: {type(exc).__name__}: {exc}", traceback.format_exc()) from exc
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
    return _spawn(job, nproc, timeout_s, cancel, progress, slot * nproc)


def _fields(job: WorkerJob) -> dict[str, object]:
    return {name: getattr(job, name) for name in job.__dataclass_fields__}


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _spawn(
    job: WorkerJob,
    nproc: int,
    timeout_s: float,
    cancel: threading.Event | None,
    progress: Callable[[str], None] | None,
    first_device: int = 0,
) -> list[ConfigOutcome]:
    from axrl_spike_replay.processes.process_starts import rank_context

    lines = rank_context().SimpleQueue() if progress is not None else None
    relay = _Relay(lines, progress) if lines is not None and progress is not None else None
    with owned_temp_dir("axrl-replay-") as tmp:  # removed even if this process is killed
        outcomes_path = str(Path(tmp) / _OUTCOMES)
        try:
            _spawn_ranks(job, nproc, (outcomes_path, lines, first_device), timeout_s, cancel)
        finally:
            if relay is not None:
                relay.stop()
        doc = json.loads(Path(outcomes_path).read_text(encoding="utf-8"))
    return [ConfigOutcome(**item) for item in doc]


class _Relay:
    """Hands the rank processes' progress lines to `progress` as they come (a thread reading their queue)."""

    def __init__(self, lines: Any, progress: Callable[[str], None]) -> None:
        self.lines, self.progress = lines, progress
        self.thread = threading.Thread(target=self._run, name="replay-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            line = self.lines.get()
            if line is None:
                return
            self.progress(line)

    def stop(self) -> None:
        self.lines.put(None)
        self.thread.join(timeout=5.0)


def _spawn_ranks(
    job: WorkerJob, nproc: int, out: tuple[str, Any, int], timeout_s: float, cancel: threading.Event | None
) -> None:
    spawn_ranks(
        _process,
        nproc,
        (job, *out),
        backend=backend_for(job.device, nproc),
        timeout_s=timeout_s,
        prepare=_prepare_process,
        label="replay",
        cancel=cancel,
        native_crash_retries=1,  # a replay only reads the snapshot: rerunning it is safe
    )


def _prepare_process(process: int, payload: tuple[WorkerJob, str, Any, int]) -> None:
    prepare_device(process_device(payload[0].device, payload[3] + process))


def _process(process: int, nproc: int, payload: tuple[WorkerJob, str, Any, int]) -> None:
    job, outcomes_path, lines, first_device = payload
    run_share(
        job,
        outcomes_path,
        device=process_device(job.device, first_device + process),
        progress=lines.put if lines is not None else None,
    )


def run_share(
    job: WorkerJob,
    outcomes_path: str | None = None,
    *,
    device: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[ConfigOutcome]:
    """This process's share of a replay job, in a process group someone else started (our spawn, a warm pool,
    torchrun, `srun`): process `dist.get_rank()` of `len(job.assignment)` replays its saved ranks (whole or its
    shards, as `job.shard` says) and takes part in the reduction; process 0 writes the outcomes to `outcomes_path`
    (JSON, atomically) when given. Every process returns the same outcomes. The caller owns the group: it calls
    `dist.barrier()` before `destroy_process_group`, since a process that tears gloo down while a peer is still
    in the job's last collective aborts.

    `device`: this process's device (default: `job.device`, with `cuda` meaning the GPU of `LOCAL_RANK`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise AxrlError("a replay process runs in an initialised process group (torch.distributed.init_process_group)")
    process, size = dist.get_rank(), dist.get_world_size()
    if size != len(job.assignment):
        raise AxrlError(f"the replay job is laid out for {len(job.assignment)} processes; the group has {size}")
    if device is None:
        device = process_device(job.device, int(os.environ.get("LOCAL_RANK", process)))
        prepare_device(device)
    local = WorkerJob(**{**_fields(job), "device": device})
    outcomes = compute(local, process, progress=progress)
    if process == 0 and outcomes_path is not None:
        atomic_write_json(outcomes_path, [asdict(o) for o in outcomes])
    return outcomes


def parallel_slots(nproc: int, device: str, requested: int | None) -> int:
    """How many pools of `nproc` processes a sweep runs its configs on side by side: `requested`, else on CUDA
    as many as the visible GPUs hold (one GPU per process), else one (CPU slots are the user's to give)."""
    if requested is not None:
        return max(requested, 1)
    if device == "cuda":
        import torch

        return max(torch.cuda.device_count() // nproc, 1)
    return 1


class _EitherCancel(threading.Event):
    """Set when it is set here (a slot failed) or when the caller's own cancel flag is."""

    def __init__(self, outer: threading.Event | None) -> None:
        super().__init__()
        self.outer = outer

    def is_set(self) -> bool:
        return super().is_set() or (self.outer is not None and self.outer.is_set())


def configs_in_parallel(runner: JobRunner, requested: int | None) -> JobRunner:
    """A runner that spreads a job's configs over several pools (slots) of the job's layout and merges the
    outcomes in the configs' order; the same outcomes as `runner` on the whole job.

    Every slot computes the baseline first (the engine puts it first): its gradient and per-token traces are
    what the mitigated configs' footprint, cosine and clean-gradient figures are measured against, in the
    same process. Slot 0's baseline is the one returned. A failing slot stops the others.
    """

    def run(
        job: WorkerJob,
        timeout_s: float = RUN_TIMEOUT_S,
        cancel: threading.Event | None = None,
        *,
        progress: Callable[[str], None] | None = None,
        slot: int = 0,
    ) -> list[ConfigOutcome]:
        nproc = len(job.assignment)
        slots = min(parallel_slots(nproc, job.device, requested), len(job.configs) - 1)
        if slots <= 1:
            return runner(job, timeout_s, cancel, progress=progress, slot=slot)
        baseline, rest = job.configs[0], job.configs[1:]
        chunks = [rest[i * len(rest) // slots : (i + 1) * len(rest) // slots] for i in range(slots)]
        if progress is not None:
            sizes = ", ".join(str(len(c)) for c in chunks)
            progress(f"running {len(rest)} config(s) on {slots} pools of {nproc} process(es) ({sizes} each)")
        stop = _EitherCancel(cancel)

        def one(i: int) -> list[ConfigOutcome]:
            say = progress
            tagged = (lambda line: say(f"[pool {i}] {line}")) if say is not None else None
            try:
                return runner(replace(job, configs=(baseline, *chunks[i])), timeout_s, stop, progress=tagged, slot=i)
            except BaseException:
                stop.set()  # the other slots stop at their next config
                raise

        with ThreadPoolExecutor(max_workers=slots, thread_name_prefix="sweep-slot") as pool:
            futures = [pool.submit(one, i) for i in range(slots)]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:  # the first real failure, not the cancellations it caused
            from axrl_spike_replay.processes.rank_processes import RunCancelled

            raise next((e for e in errors if not isinstance(e, RunCancelled)), errors[0])  # type: ignore[misc]
        parts = [f.result() for f in futures]
        return [parts[0][0], *(outcome for part in parts for outcome in part[1:])]

    return run
