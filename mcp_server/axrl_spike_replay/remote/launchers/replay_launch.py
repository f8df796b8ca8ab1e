"""The replay's processes started by the engines users run training with: torchrun agents on SSH nodes (one
c10d rendezvous), or `srun` → torchrun inside a Slurm allocation.

`LaunchedRunner` is a `replay.jobs.job_runner.JobRunner`: the engine hands it the same `WorkerJob` it hands our spawn
launcher, and gets back the same outcomes, computed by `replay.jobs.torchrun_worker` in processes torchrun started.
The job travels as JSON (`replay.jobs.job_document`); every node must see the snapshot at the same path (checked
before anything starts: the checkpoint metadata's size there against the one here). A failure names the node
and, when a replay process said why it stopped, says that instead of torchrun's own summary. Cancel (the
caller's event, Ctrl-C, SIGTERM) and timeout end the job on every node (`scancel` on Slurm).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from axrl_spike_replay.display import clean_text
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.processes.rank_processes import RunCancelled
from axrl_spike_replay.processes.run_limit import RunLimit
from axrl_spike_replay.remote.launchers.launch_job import LaunchError, LaunchNode, LaunchOutcome, WorkerEntry
from axrl_spike_replay.remote.launchers.launcher import DryRun, Launcher
from axrl_spike_replay.remote.launchers.slurm_command import SlurmSettings
from axrl_spike_replay.remote.launchers.slurm_launch import SlurmJob, SlurmLauncher
from axrl_spike_replay.remote.launchers.torchrun_command import DEFAULT_RENDEZVOUS_TIMEOUT_S
from axrl_spike_replay.remote.launchers.torchrun_launch import TorchrunJob, TorchrunLauncher
from axrl_spike_replay.remote.transport.cancellable import cancellable
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.jobs.job_document import job_document
from axrl_spike_replay.replay.jobs.torchrun_worker import (
    CRASH_MARK,
    ERROR_MARK,
    RESULT_KIND,
    payload_for,
    snapshot_check,
)

REPLAY_WORKER = WorkerEntry(module="axrl_spike_replay.replay.jobs.torchrun_worker")
LAUNCH_DIR = "launch"  # in the run dir: the launcher's command lines, requests and every node's logs
T = TypeVar("T")


@dataclass(frozen=True)
class Placement:
    """Where a launched replay's processes run: torchrun agents on `nodes` (the first hosts the rendezvous), or
    a Slurm allocation submitted from `login`."""

    name: str  # as the user named it: a `multinode:` or `slurm:` entry, or the targets joined with '+'
    nodes: tuple[LaunchNode, ...] = ()
    nproc_per_node: int = 1
    rendezvous_port: int | None = None
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    login: LaunchNode | None = None  # Slurm
    slurm: SlurmSettings | None = None

    def __post_init__(self) -> None:
        if (self.slurm is None) == (not self.nodes):
            raise ValueError("a placement is torchrun nodes or a Slurm allocation, exactly one of them")
        if self.slurm is not None and self.login is None:
            raise ValueError("a Slurm placement needs its login node")

    @property
    def launcher(self) -> str:
        return "slurm" if self.slurm is not None else "torchrun"

    @property
    def node_count(self) -> int:
        return self.slurm.nodes if self.slurm is not None else len(self.nodes)

    @property
    def per_node(self) -> int:
        return self.slurm.processes_per_node if self.slurm is not None else self.nproc_per_node

    @property
    def processes(self) -> int:
        return self.node_count * self.per_node

    def describe(self) -> str:
        """In words, for progress lines and errors."""
        if self.slurm is not None:
            assert self.login is not None
            partition = self.slurm.partition or "the default partition"
            return (
                f"Slurm from {self.login.name} ({partition}): {self.node_count} node(s) x {self.per_node} process(es)"
            )
        names = ", ".join(n.name for n in self.nodes)
        return f"torchrun on {names}: {self.node_count} node(s) x {self.per_node} process(es)"

    def launcher_for(self, options: RemoteOptions | None = None) -> Launcher[Any]:
        """The launcher that starts this placement's processes."""
        return SlurmLauncher(options) if self.slurm is not None else TorchrunLauncher(options)

    def job_for(
        self, payload: Mapping[str, Any], timeout_s: float | None = None, shared: Mapping[str, int] | None = None
    ) -> TorchrunJob | SlurmJob:
        """The replay worker's job on this placement: `payload` in its request, `shared` files every node sees."""
        shared = dict(shared or {})
        if self.slurm is not None:
            assert self.login is not None
            return SlurmJob(self.login, REPLAY_WORKER, self.slurm, payload=payload, timeout_s=timeout_s,
                            shared_files=shared)  # fmt: skip
        return TorchrunJob(
            nodes=self.nodes,
            worker=REPLAY_WORKER,
            nproc_per_node=self.nproc_per_node,
            payload=payload,
            rendezvous_port=self.rendezvous_port,
            rendezvous_timeout_s=self.rendezvous_timeout_s,
            timeout_s=timeout_s,
            shared_files=shared,
        )

    def dry_run(self, options: RemoteOptions | None = None) -> DryRun:
        """What launching a replay here would run (the job itself travels in the request file)."""
        return self.launcher_for(options).dry_run(self.job_for({}))


@dataclass
class LaunchedRunner:
    """Runs a replay job's processes on a placement; `last` is the launch that produced the latest outcomes."""

    placement: Placement
    options: RemoteOptions = field(default_factory=RemoteOptions)
    out_dir: Callable[[], Path | None] = lambda: None  # where the launch's logs go (the run dir); None: a temp dir
    backend: str = "gloo"  # the process group's: gloo, or nccl on CUDA with a GPU per process
    timeout_s: float | None = None  # the whole run, from the agents' (or the Slurm job's) start
    last: LaunchOutcome | None = None

    def __call__(
        self,
        job: WorkerJob,
        timeout_s: float = RUN_TIMEOUT_S,
        cancel: threading.Event | None = None,
        *,
        progress: Callable[[str], None] | None = None,
        slot: int = 0,
    ) -> list[ConfigOutcome]:
        """The outcomes of `job` (process 0's, after the reduction), computed where the placement says."""
        if slot != 0:
            raise ConfigError("`parallel_configs` spreads a sweep over pools on this machine, not over launched jobs")
        placement = self.placement
        if len(job.assignment) != placement.processes:
            raise ConfigError(
                f"`nproc` {len(job.assignment)} does not fit {placement.describe()} = {placement.processes} "
                "process(es)",
                "nproc",
            )
        check = snapshot_check(job.replay_dir)
        payload = payload_for(job_document(job), backend=self.backend, timeout_s=timeout_s, snapshot_check=check)
        shared = {str(check["path"]): int(check["bytes"])} if check else {}
        say = progress or (lambda _line: None)
        say(f"launching {len(job.assignment)} replay process(es): {placement.describe()}")
        given = self.out_dir()
        with contextlib.ExitStack() as stack:
            if given is None:
                out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="axrl-launch-")))
            else:
                out = given / LAUNCH_DIR
            # this launcher holds the run to its own `timeout_s`, from the agents' start, and names the nodes it
            # stopped: the engine's time limit would stop it first, counting the launch, and say less
            caller = cancel.cancel if isinstance(cancel, RunLimit) and self.timeout_s is not None else cancel
            outcome = run_cancellable(self._launch(payload, shared, out, say), caller)
            self.last = outcome
            result = outcome.result
        if result.get("kind") != RESULT_KIND or not isinstance(result.get("outcomes"), list):
            raise LaunchError(f"the replay job {outcome.launch_id} gave no outcomes (its result is of another kind)")
        say(
            f"{outcome.launch_id}: {placement.launcher} job done in {outcome.seconds:.1f} s "
            f"(every process started after {outcome.start_s:.1f} s)"
        )
        outcomes = [ConfigOutcome(**item) for item in result["outcomes"]]
        for item in outcomes:
            item.timings = {**item.timings, "launch_start": outcome.start_s, "launch": outcome.seconds}
        return outcomes

    async def _launch(
        self, payload: dict[str, Any], shared: Mapping[str, int], out: Path, say: Callable[[str], None]
    ) -> LaunchOutcome:
        placement = self.placement
        try:
            launcher = placement.launcher_for(self.options)
            job = placement.job_for(payload, self.timeout_s, shared)

            def line(stream: str, text: str) -> None:
                if stream == "stderr" and "@@axrl" not in text:
                    say(text)

            return await launcher.launch(job, out, progress=say, on_line=line)
        except LaunchError as exc:
            raise replay_error(exc, out, placement) from None


def replay_error(exc: LaunchError, out: Path, placement: Placement) -> LaunchError:
    """`exc`, or, when a replay process printed why it stopped, an error that says that and names the node."""
    said = _worker_lines(out, placement)
    if not said or exc.timed_out:  # stopped for its timeout: what processes said as they were stopped came after
        return exc
    # expected failures before crashes (a peer's broken connection is a consequence), the failed node's own first
    node, _rank, text = min(said, key=lambda item: (item[1], item[0] != exc.node))
    node = node or exc.node
    where = f"node {node!r}" if node else "a node"
    return LaunchError(
        f"the replay failed on {where}: {text}. The job was stopped on every node (its logs: {out})", node=node
    )


def _worker_lines(out: Path, placement: Placement) -> list[tuple[str | None, int, str]]:
    """(node, 0 for an expected failure and 1 for a crash, text) of each replay process's last words in the
    job's logs here (torchrun: one stderr log per node; Slurm: the job's output)."""
    logs: list[tuple[str | None, Path]] = []
    for index, node in enumerate(placement.nodes):
        logs += [(node.name, log) for log in out.glob(f"node{index}-*.stderr.log")]
    logs += [(None, log) for log in out.glob("slurm-*.out")]
    found: list[tuple[str | None, int, str]] = []
    for node, log in logs:
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                for kind, mark in enumerate((ERROR_MARK, CRASH_MARK)):
                    if mark in line:
                        found.append((node, kind, clean_text(line.split(mark, 1)[1].strip())))
    return found


def run_cancellable(work: Awaitable[T], cancel: threading.Event | None) -> T:
    """Run `work` to its end in a fresh event loop; setting `cancel` (a cancelled MCP call) stops it as Ctrl-C does
    (the work's own clean-up runs) and raises RunCancelled."""
    stopped = RunCancelled("replay cancelled: its processes were stopped on every node")
    return asyncio.run(cancellable(work, cancel, stopped))
