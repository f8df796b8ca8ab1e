"""Read-only work over FSDP2 processes (a sharded attribution, diagnose's sharded model evidence): each process on
its own device runs its share of a job, and process 0's JSON document comes back. Spawned as the replay spawns its
ranks; a native crash is retried once, since the work only reads the snapshot."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from axrl_spike_replay.files.atomic import atomic_write_json

# (the job, moved to this process's device; this process's index) -> the document process 0 hands back
Share = Callable[[Any, int], dict[str, Any]]


def run_share_processes(
    share: Share, job: Any, label: str, timeout_s: float, cancel: threading.Event | None = None
) -> dict[str, Any]:
    """Run `share` on `len(job.assignment)` spawned processes (gloo on CPU; nccl with a GPU per process) and return
    process 0's document. `share` is a module-level function (it is sent to the processes); `job` a dataclass with
    `device` and `assignment`. Setting `cancel` stops every process (RunCancelled)."""
    from axrl_spike_replay.files.temp_janitor import owned_temp_dir
    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.replay.jobs.job_runner import backend_for

    nproc = len(job.assignment)
    with owned_temp_dir(f"axrl-{label}-") as tmp:
        path = str(Path(tmp) / "share.json")
        spawn_ranks(
            _process,
            nproc,
            (share, job, path),
            backend=backend_for(job.device, nproc),
            timeout_s=timeout_s,
            prepare=_prepare,
            label=label,
            cancel=cancel,
            native_crash_retries=1,  # it only reads the snapshot: rerunning it is safe
        )
        return json.loads(Path(path).read_text(encoding="utf-8"))


def _prepare(process: int, payload: tuple[Share, Any, str]) -> None:
    from axrl_spike_replay.replay.jobs.job_runner import prepare_device, process_device

    prepare_device(process_device(payload[1].device, process))


def _process(process: int, nproc: int, payload: tuple[Share, Any, str]) -> None:
    import torch

    from axrl_spike_replay.replay.jobs.job_runner import process_device

    share, job, path = payload
    torch.set_num_threads(1)
    doc = share(replace(job, device=process_device(job.device, process)), process)
    if process == 0:
        atomic_write_json(path, doc)
