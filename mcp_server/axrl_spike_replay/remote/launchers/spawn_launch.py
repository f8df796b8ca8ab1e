"""The spawn launcher: a replay job's rank processes on this machine (`replay.jobs.job_runner.run_job`: one process here
in this process, several forked from a server that imported torch once, else spawned), behind the launcher
protocol. Its result is the one torchrun's workers write (`replay.jobs.torchrun_worker`), so a caller reads every
launcher's outcome the same way; its log is the job's progress lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.remote.launchers.launch_job import LaunchOutcome
from axrl_spike_replay.remote.launchers.launcher import DryRun, Launcher, LaunchStatus, elapsed
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.job import LineCallback
from axrl_spike_replay.replay.jobs.torchrun_worker import RESULT_KIND

if TYPE_CHECKING:  # the engine's types; this module stays light for `plan` and `--dry-run`
    from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob

LOG_FILE = "spawn.log"
SPAWN_RESULT_FILE = "result.json"
HERE = "local"


def spawn_dry_run(nproc: int, device: str, shard: bool = False) -> DryRun:
    """What the spawn launcher would run for `nproc` processes on `device` (`shard`: FSDP2 over them)."""
    if nproc == 1 and not shard:
        how = "in this process (no process is started)"
    else:
        group = "gloo" if device == "cpu" else "nccl with a GPU per process, else gloo"
        how = f"rank processes forked from a server that imported torch once, else spawned; process group {group}"
    commands = tuple(f"# process {i}: device {_device(device, i)}" for i in range(nproc))
    notes = ("the model sharded by FSDP2 over the processes",) if shard else ()
    return DryRun("spawn", f"this machine, {how}", nproc, commands, notes)


def _device(device: str, process: int) -> str:
    return f"cuda:{process} (modulo the visible GPUs)" if device == "cuda" else device


class SpawnLauncher(Launcher["WorkerJob"]):
    """Rank processes on this machine, meeting over a FileStore in a private temp dir."""

    name = "spawn"

    def __init__(self, timeout_s: float = RUN_TIMEOUT_S) -> None:
        super().__init__()
        self.timeout_s = timeout_s

    def dry_run(self, job: WorkerJob) -> DryRun:
        """The processes and their devices; each replays the saved ranks of its share of `job.assignment`."""
        dry = spawn_dry_run(len(job.assignment), job.device, job.shard)
        commands = tuple(
            f"{line}; saved rank(s) {', '.join(map(str, ranks))}"
            for line, ranks in zip(dry.commands, job.assignment, strict=True)
        )
        return dataclasses.replace(dry, commands=commands)

    async def run(
        self,
        job: WorkerJob,
        out_dir: Path,
        status: LaunchStatus,
        *,
        progress: Callable[[str], None],
        on_line: LineCallback | None = None,
    ) -> LaunchOutcome:
        """Run the job's processes (in a thread of this process) to their end; cancelling stops them."""
        from axrl_spike_replay.replay.jobs.job_runner import run_job

        began = time.monotonic()
        log = out_dir / LOG_FILE
        lock = threading.Lock()
        log.write_text("", encoding="utf-8")

        def say(line: str) -> None:
            with lock, open(log, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
            if on_line is not None:
                on_line("stderr", line)
            progress(line)

        cancel = threading.Event()
        status.state = "running"
        work = asyncio.ensure_future(asyncio.to_thread(run_job, job, self.timeout_s, cancel, progress=say))
        try:
            outcomes: list[ConfigOutcome] = await asyncio.shield(work)
        except asyncio.CancelledError:
            cancel.set()  # the processes stop at once; wait for them (bounded by their own stop)
            await run_to_completion(asyncio.wait({work}))
            if not work.cancelled():
                work.exception()  # retrieved: its RunCancelled is this cancellation's consequence
            raise
        result = {"kind": RESULT_KIND, "outcomes": [dataclasses.asdict(o) for o in outcomes]}
        result_path = atomic_write_json(out_dir / SPAWN_RESULT_FILE, result)
        seconds = elapsed(began)
        return LaunchOutcome(
            launcher=self.name,
            launch_id=status.launch_id,
            nodes=(HERE,),
            result=result,
            result_path=result_path,
            out_dir=out_dir,
            seconds=seconds,
            start_s=seconds,  # the rank processes report no start of their own; the whole run is an upper bound
            logs={"spawn": log},
        )
