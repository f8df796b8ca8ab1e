"""One protocol for every launcher of a job's processes (after torchx's `Scheduler`): `dry_run` says what it would
run without starting anything (what `plan` and `--dry-run` print), `submit` starts the job and gives back a `Launch`
whose `status`, `cancel`, `logs` and `wait` follow it. The backends, one file each: `spawn_launch` (rank processes
on this machine), `torchrun_launch` (one torchrun agent per node over SSH) and `slurm_launch` (an allocation whose
batch script starts the agents with `srun`).

What the SSH backends share lives here too: opening a node's session (this machine's when the node has no target),
the request file, the check that a node sees the job's shared files as this machine does, and the outcome record.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.remote.launchers.launch_job import (
    LaunchError,
    LaunchNode,
    LaunchOutcome,
    new_launch_id,
    request_document,
    shared_files_error,
    shared_files_problems,
    shared_files_script,
)
from axrl_spike_replay.remote.transport.connect import connect_settings
from axrl_spike_replay.remote.transport.job import LineCallback, Session
from axrl_spike_replay.remote.transport.local_session import LocalSession
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.transport.remote_errors import RemoteError
from axrl_spike_replay.remote.transport.session import open_session
from axrl_spike_replay.remote.transport.shell import bash_command

J = TypeVar("J")
State = Literal["starting", "pending", "running", "succeeded", "failed", "cancelled"]
LOG_SUFFIXES = (".log", ".out")


@dataclass(frozen=True)
class DryRun:
    """What a launch would run: the launcher, where, how many processes, its command lines, and what is decided
    only when it starts (a rendezvous port, a job directory)."""

    launcher: str
    where: str
    processes: int
    commands: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def text(self) -> str:
        """Lines for people: the head, then each command indented."""
        lines = [f"{self.launcher}: {self.where} ({self.processes} process(es))"]
        lines += ["  " + line for command in self.commands for line in command.splitlines()]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The same as a JSON object (with `text`, the lines for people)."""
        return {
            "launcher": self.launcher,
            "where": self.where,
            "processes": self.processes,
            "commands": list(self.commands),
            "notes": list(self.notes),
            "text": self.text(),
        }


@dataclass
class LaunchStatus:
    """Where a launch is: its state, the id the launcher gave it, what it last said, and when it ended the error."""

    launcher: str
    launch_id: str
    state: State = "starting"
    detail: str = ""
    job_id: str | None = None  # Slurm's
    error: BaseException | None = field(default=None, repr=False)

    @property
    def ended(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled")


class Launch:
    """A submitted job: follow it (`status`, `logs`), stop it (`cancel`: its processes end on every node), or
    await its outcome (`wait`, which raises the launcher's error)."""

    def __init__(self, status: LaunchStatus, out_dir: Path, task: asyncio.Task[LaunchOutcome]) -> None:
        self._status, self.out_dir, self._task = status, out_dir, task
        task.add_done_callback(self._ended)

    @property
    def launch_id(self) -> str:
        return self._status.launch_id

    def status(self) -> LaunchStatus:
        """The launch's state now (a copy)."""
        s = self._status
        return LaunchStatus(s.launcher, s.launch_id, s.state, s.detail, s.job_id, s.error)

    def logs(self) -> dict[str, Path]:
        """The job's log files here so far, by name (the launcher copies each node's output into `out_dir`)."""
        if not self.out_dir.is_dir():
            return {}
        found = sorted(p for p in self.out_dir.iterdir() if p.is_file() and p.suffix in LOG_SUFFIXES)
        return {p.name.removesuffix(p.suffix): p for p in found}

    def cancel(self) -> None:
        """Stop the job: its clean-up runs (process groups killed on every node, `scancel` on Slurm)."""
        self._task.cancel()

    async def wait(self) -> LaunchOutcome:
        """The outcome once the job ended successfully; its LaunchError (or the cancellation) otherwise."""
        return await self._task

    def _ended(self, task: asyncio.Task[LaunchOutcome]) -> None:
        status = self._status
        if task.cancelled():
            status.state, status.detail = "cancelled", "cancelled; its processes were stopped"
        elif task.exception() is not None:
            status.state, status.error = "failed", task.exception()
            status.detail = str(task.exception())
        else:
            status.state, status.detail = "succeeded", f"done in {task.result().seconds:.1f} s"


class Launcher(ABC, Generic[J]):
    """A way to start a job's processes. Backends implement `dry_run` and `run`; `submit` is shared."""

    name: ClassVar[str]

    def __init__(self, options: RemoteOptions | None = None) -> None:
        self.options = options or RemoteOptions()

    @abstractmethod
    def dry_run(self, job: J) -> DryRun:
        """What launching `job` would run, without connecting anywhere or starting anything."""

    @abstractmethod
    async def run(
        self,
        job: J,
        out_dir: Path,
        status: LaunchStatus,
        *,
        progress: Callable[[str], None],
        on_line: LineCallback | None = None,
    ) -> LaunchOutcome:
        """Run `job` to its end (updating `status`); its logs, request and result go to `out_dir`."""

    def submit(
        self,
        job: J,
        out_dir: Path,
        *,
        launch_id: str | None = None,
        progress: Callable[[str], None] | None = None,
        on_line: LineCallback | None = None,
    ) -> Launch:
        """Start `job` in the running event loop and return its `Launch` at once."""
        status = LaunchStatus(self.name, launch_id or new_launch_id())
        out_dir.mkdir(parents=True, exist_ok=True)
        say = progress or (lambda _message: None)

        def told(message: str) -> None:
            status.detail = message
            say(message)

        task = asyncio.ensure_future(self.run(job, out_dir, status, progress=told, on_line=on_line))
        return Launch(status, out_dir, task)

    async def launch(
        self,
        job: J,
        out_dir: Path,
        *,
        launch_id: str | None = None,
        progress: Callable[[str], None] | None = None,
        on_line: LineCallback | None = None,
    ) -> LaunchOutcome:
        """`submit`, then `wait`: the outcome of `job` run to its end."""
        return await self.submit(job, out_dir, launch_id=launch_id, progress=progress, on_line=on_line).wait()

    async def open_node(self, node: LaunchNode, where: str = "node") -> Session:
        """A session on `node` (this machine's when it has no target); LaunchError names it when it is unreachable."""
        if node.target is None:
            return LocalSession()
        options = self.options
        settings = connect_settings(options.known_hosts or node.target.known_hosts, options.accept_new_host_key)
        try:
            session = await open_session(node.target.ssh, settings)
        except RemoteError as exc:
            raise LaunchError(f"{where} {node.name!r}: cannot connect: {exc}", node=node.name) from None
        session.label = node.name
        return session


def write_request(path: Path, launch_id: str, result_path: str, payload: Mapping[str, Any]) -> Path:
    """The request file here (copied to the node next): the job, where rank 0 writes its result, the payload."""
    return atomic_write_json(path, request_document(launch_id, result_path, payload))


async def shared_files_seen(
    session: Session, files: Mapping[str, int], node: str, host: str | None, where: str = "node"
) -> LaunchError | None:
    """None when the node sees `files` at the same paths and sizes as this machine; else the error naming it."""
    got = await session.capture(bash_command(shared_files_script(files)))
    problems = shared_files_problems(got.stdout, files)
    return shared_files_error(node, host, problems, where=where) if problems else None


def elapsed(began: float) -> float:
    """Seconds since `began` (time.monotonic), as outcomes record them."""
    return round(time.monotonic() - began, 3)
