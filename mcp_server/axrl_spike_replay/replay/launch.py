"""Run a replay job: one process per replay rank with torch.distributed, or in this process for one.

Processes are spawned with torch.multiprocessing and meet over a FileStore in a private temp dir
(gloo on CPU; nccl on CUDA when every process has its own GPU, else gloo). Each runs with one
intra-op thread, as the reference trainer's ranks do, so reductions are deterministic.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

from axrl_spike_replay.atomic import atomic_write_json
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.replay.worker import ConfigOutcome, WorkerJob, compute

_OUTCOMES = "outcomes.json"


class ReplayProcessError(AxrlError):
    """A replay process failed; `details` holds its traceback when the failure was not expected input."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def process_device(device: str, process: int) -> str:
    """The device replay process `process` computes on."""
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


def _prepare_device(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)


def run_job(job: WorkerJob, timeout_s: float = 1800.0) -> list[ConfigOutcome]:
    """Outcomes of `job` (one per config, process 0's view after the reduction)."""
    import torch

    nproc = len(job.assignment)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if nproc == 1 and not _dist_initialized():
        threads = torch.get_num_threads()
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.set_num_threads(1)
        try:
            local = WorkerJob(**{**_fields(job), "device": process_device(job.device, 0)})
            _prepare_device(local.device)
            return compute(local, 0)
        except AxrlError:
            raise
        except Exception as exc:
            raise ReplayProcessError(f"replay failed: {type(exc).__name__}: {exc}", traceback.format_exc()) from exc
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
    return _spawn(job, nproc, timeout_s)


def _fields(job: WorkerJob) -> dict[str, object]:
    return {name: getattr(job, name) for name in job.__dataclass_fields__}


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _spawn(job: WorkerJob, nproc: int, timeout_s: float) -> list[ConfigOutcome]:
    import torch.multiprocessing as mp

    backend = backend_for(job.device, nproc)
    with tempfile.TemporaryDirectory(prefix="axrl-replay-") as tmp:
        try:
            mp.spawn(_entry, args=(job, nproc, backend, tmp, timeout_s), nprocs=nproc, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise _collect_error(Path(tmp), exc) from None
        doc = json.loads((Path(tmp) / _OUTCOMES).read_text(encoding="utf-8"))
    return [ConfigOutcome(**item) for item in doc]


def _collect_error(tmp: Path, exc: Exception) -> ReplayProcessError:
    expected = sorted(tmp.glob("error-process*.txt"))
    if expected:
        return ReplayProcessError(expected[0].read_text(encoding="utf-8").strip())
    traces = sorted(tmp.glob("trace-process*.txt"))
    if traces:
        text = traces[0].read_text(encoding="utf-8")
        last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
        return ReplayProcessError(f"{traces[0].stem.removeprefix('trace-')}: {last}", text)
    return ReplayProcessError(f"a replay process died: {str(exc).strip().splitlines()[0]}", str(exc))


def _entry(process: int, job: WorkerJob, nproc: int, backend: str, tmp: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = process_device(job.device, process)
    try:
        _prepare_device(device)
        store = dist.FileStore(str(Path(tmp) / "store"), nproc)
        dist.init_process_group(
            backend, store=store, rank=process, world_size=nproc, timeout=timedelta(seconds=timeout_s)
        )
        outcomes = compute(WorkerJob(**{**_fields(job), "device": device}), process)
        if process == 0:
            atomic_write_json(Path(tmp) / _OUTCOMES, [asdict(o) for o in outcomes])
        dist.barrier()  # every process is done with the group before any tears it down
    except AxrlError as exc:
        Path(tmp, f"error-process{process}.txt").write_text(f"replay process {process}: {exc}", encoding="utf-8")
        raise
    except BaseException:
        Path(tmp, f"trace-process{process}.txt").write_text(traceback.format_exc(), encoding="utf-8")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
