"""Run a job with torchrun on one node or many: one agent per node over SSH (or here), one c10d rendezvous.

Before anything starts, every node is probed (its Python, torch and this package); a node that cannot run the
job is refused by name. Then rank 0's node chooses a free port for the rendezvous store, every node gets the
request file, and the agents start together. The first agent that fails (its process exits non-zero or its SSH
connection drops) ends the job everywhere with an error naming that node; a rendezvous that times out names the
nodes whose agent never started. Cancel and timeout end the job the same way: each agent's process group is
killed, then a sweep ends any process still carrying the job's tag (torchrun's workers live in sessions of their
own), so no process is left on any node. Rank 0's result is fetched only after every agent succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.files.atomic import atomic_write_text
from axrl_spike_replay.remote.launchers.launch_job import (
    REQUEST_FILE,
    RESULT_FILE,
    LaunchError,
    LaunchNode,
    LaunchOutcome,
    WorkerEntry,
    check_node_ready,
    read_result,
    tail_text,
)
from axrl_spike_replay.remote.launchers.launcher import (
    DryRun,
    Launcher,
    LaunchStatus,
    elapsed,
    shared_files_seen,
    write_request,
)
from axrl_spike_replay.remote.launchers.torchrun_command import (
    AGENT_STARTED,
    DEFAULT_RENDEZVOUS_TIMEOUT_S,
    Rendezvous,
    agent_script,
    free_port_script,
    parse_sweep,
    rendezvous_failure,
    sweep_script,
    torchrun_argv,
)
from axrl_spike_replay.remote.launchers.torchrun_failure import AgentState, explain_failure, timeout_error
from axrl_spike_replay.remote.nodes.node_probe import NodeReport, probe
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.job import JobOutcome, LineCallback, Session
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.transport.remote_errors import RemoteError
from axrl_spike_replay.remote.transport.shell import bash_command

SWEEP_GRACE_S = 5
CLEANUP_TIMEOUT_S = 60.0
_FILE_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class TorchrunJob:
    """A job for torchrun: its nodes (the first hosts the rendezvous store), processes per node, the worker."""

    nodes: tuple[LaunchNode, ...]
    worker: WorkerEntry
    nproc_per_node: int = 1
    payload: Mapping[str, Any] = field(default_factory=dict)
    rendezvous_port: int | None = None  # default: a port free on the first node when the job starts
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    timeout_s: float | None = None  # the whole run, from the agents' start
    env: Mapping[str, str] = field(default_factory=dict)  # exported for the agents and their workers
    shared_files: Mapping[str, int] = field(default_factory=dict)  # path -> size every node must see (the snapshot)

    def __post_init__(self) -> None:
        names = [node.name for node in self.nodes]
        if not names:
            raise ValueError("a torchrun job needs at least one node")
        if len(set(names)) != len(names):
            raise ValueError(f"node names must differ: {names}")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be at least 1, got {self.nproc_per_node}")
        if not self.rendezvous_timeout_s > 0 or (self.timeout_s is not None and not self.timeout_s > 0):
            raise ValueError("timeouts must be positive numbers of seconds")


@dataclass
class _Agent:
    """A node's share of a running job."""

    node: LaunchNode
    index: int
    session: Session
    report: NodeReport | None = None
    temp_dir: str | None = None
    started: bool = False
    task: asyncio.Task[JobOutcome] | None = None
    outcome: JobOutcome | None = None

    @property
    def log_stem(self) -> str:
        return f"node{self.index}-{_FILE_SAFE.sub('_', self.node.name)[:40]}"


class TorchrunLauncher(Launcher[TorchrunJob]):
    """One torchrun agent per node over SSH (or here), meeting at one c10d rendezvous."""

    name = "torchrun"

    def dry_run(self, job: TorchrunJob) -> DryRun:
        """Each node's torchrun command line; the rendezvous port and the nodes' temp dirs are chosen at launch."""
        first = job.nodes[0]
        several = len(job.nodes) > 1 or job.rendezvous_port is not None
        port = str(job.rendezvous_port) if job.rendezvous_port is not None else "PORT"
        endpoint = f"{first.address or first.name}:{port}" if several else None
        commands = []
        for index, node in enumerate(job.nodes):
            argv = torchrun_argv(
                node.python,
                job.worker,
                f"TEMP/{REQUEST_FILE}",
                nproc_per_node=job.nproc_per_node,
                nnodes=len(job.nodes),
                endpoint=endpoint,
                run_id="LAUNCH_ID" if several else None,
                timeout_s=job.rendezvous_timeout_s if several else None,
                is_host=(index == 0) if several else None,
                local_addr=node.address,
            )
            setup = "".join(f"{line}\n" for line in node.setup)
            commands.append(f"# node {node.name}\n{setup}{' '.join(argv)}")
        notes = ["TEMP: a temp dir each node makes when it is probed; LAUNCH_ID: the job's fresh id"]
        if several and job.rendezvous_port is None:
            notes.append(f"PORT: a port free on {first.name} when the job starts")
        if several and not first.address:
            notes.append(f"{first.name}: its host name as the probe reports it (give `address` to fix it)")
        names = ", ".join(n.name for n in job.nodes)
        where = f"torchrun on {names}: {len(job.nodes)} node(s) x {job.nproc_per_node} process(es)"
        return DryRun(self.name, where, len(job.nodes) * job.nproc_per_node, tuple(commands), tuple(notes))

    async def run(
        self,
        job: TorchrunJob,
        out_dir: Path,
        status: LaunchStatus,
        *,
        progress: Callable[[str], None],
        on_line: LineCallback | None = None,
    ) -> LaunchOutcome:
        """Probe every node, choose the rendezvous, start the agents, wait for all of them, fetch rank 0's result."""
        launch_id, say = status.launch_id, progress
        began = time.monotonic()
        agents = await self._connect(job)
        try:
            await _prepare(agents, job, launch_id, say)
            rendezvous = await _rendezvous(agents, job, launch_id)
            _start(agents, job, launch_id, rendezvous, out_dir, on_line, say)
            status.state = "running"
            start_s = await _wait(agents, job, rendezvous, launch_id, began)
            say(f"{launch_id}: every agent ended successfully; fetching rank 0's result")
            result_path, result = await _fetch_result(agents, out_dir)
        except BaseException:
            await run_to_completion(_cleanup(agents, launch_id, say))
            raise
        await run_to_completion(_cleanup(agents, launch_id, say))
        return LaunchOutcome(
            launcher=self.name,
            launch_id=launch_id,
            nodes=tuple(a.node.name for a in agents),
            result=result,
            result_path=result_path,
            out_dir=out_dir,
            seconds=elapsed(began),
            start_s=start_s,
            rendezvous=rendezvous.endpoint if rendezvous is not None else None,
            logs={f"{a.log_stem}.{s}": out_dir / f"{a.log_stem}.{s}.log" for a in agents for s in ("stdout", "stderr")},
        )

    async def _connect(self, job: TorchrunJob) -> list[_Agent]:
        """A session per node (opened together); if one cannot be reached, the others are closed and it is named."""
        tasks = [asyncio.ensure_future(self.open_node(node)) for node in job.nodes]
        try:
            await asyncio.wait(tasks)
        finally:  # a failed or cancelled start closes what did open
            failures = [t.exception() if not t.cancelled() else asyncio.CancelledError() for t in tasks if t.done()]
            failures = [f for f in failures if f is not None]
            if failures or not all(t.done() for t in tasks):
                for task in tasks:
                    task.cancel()
                await run_to_completion(_close_opened(tasks))
        if failures:
            raise failures[0]
        pairs = enumerate(zip(job.nodes, tasks, strict=True))
        return [_Agent(node, index, task.result()) for index, (node, task) in pairs]


async def launch_torchrun(
    job: TorchrunJob,
    out_dir: Path,
    *,
    options: RemoteOptions | None = None,
    launch_id: str | None = None,
    progress: Callable[[str], None] | None = None,
    on_line: LineCallback | None = None,
) -> LaunchOutcome:
    """Run `job`; its logs, request and result go to `out_dir`. LaunchError (naming the node) when it fails."""
    launcher = TorchrunLauncher(options)
    return await launcher.launch(job, out_dir, launch_id=launch_id, progress=progress, on_line=on_line)


async def _close_opened(tasks: Sequence[asyncio.Future[Session]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is None:
            await task.result().close()


async def _prepare(agents: Sequence[_Agent], job: TorchrunJob, launch_id: str, say: Callable[[str], None]) -> None:
    """Probe every node (one round trip each, which also makes its temp dir); refuse the job if one cannot run it."""
    say(f"{launch_id}: probing {len(agents)} node(s)")
    reports = await asyncio.gather(
        *(
            probe(a.session, python=a.node.python, setup=a.node.setup, temp_prefix="axrl-launch-", import_torch=False)
            for a in agents
        ),
        return_exceptions=True,
    )
    for agent, report in zip(agents, reports, strict=True):
        if isinstance(report, NodeReport):  # first record every temp dir made, for the clean-up
            agent.report, agent.temp_dir = report, report.temp_dir
    problems: list[LaunchError] = []
    for agent, report in zip(agents, reports, strict=True):
        if isinstance(report, BaseException):
            if not isinstance(report, Exception):
                raise report
            problems.append(LaunchError(f"node {agent.node.name!r}: the probe failed: {report}", node=agent.node.name))
            continue
        try:
            check_node_ready(report, agent.node.name, python=agent.node.python)
            if agent.temp_dir is None:
                raise LaunchError(f"node {agent.node.name!r}: cannot create a temp directory", node=agent.node.name)
        except LaunchError as exc:
            problems.append(exc)
    if not problems and job.shared_files:
        problems += await _check_shared_files(agents, job.shared_files)
    if problems:
        raise LaunchError("; ".join(str(p) for p in problems), node=problems[0].node)


async def _check_shared_files(agents: Sequence[_Agent], files: Mapping[str, int]) -> list[LaunchError]:
    """Every node sees `files` at the same paths with the same sizes as this machine (one round trip each)."""
    got = await asyncio.gather(
        *(shared_files_seen(a.session, files, a.node.name, a.report.hostname if a.report else None) for a in agents),
        return_exceptions=True,
    )
    problems: list[LaunchError] = []
    for agent, seen in zip(agents, got, strict=True):
        name = agent.node.name
        if isinstance(seen, BaseException) and not isinstance(seen, Exception):
            raise seen
        if isinstance(seen, Exception):
            problems.append(LaunchError(f"node {name!r}: cannot check the snapshot there: {seen}", node=name))
        elif seen is not None:
            problems.append(seen)
    return problems


async def _rendezvous(agents: Sequence[_Agent], job: TorchrunJob, launch_id: str) -> Rendezvous | None:
    """Where the agents meet: the first node's host, a port free there now (None for one node: --standalone)."""
    if len(agents) == 1 and job.rendezvous_port is None:
        return None
    first = agents[0]
    host = first.node.address or (first.report.hostname if first.report else None)
    if not host:
        raise LaunchError(f"node {first.node.name!r}: its host name is unknown; give its `address`", first.node.name)
    port = job.rendezvous_port
    if port is None:
        got = await first.session.capture(bash_command(free_port_script(first.node.python, first.node.setup)))
        words = got.stdout.split()
        if got.exit_status != 0 or not words or not words[-1].isdigit():
            raise LaunchError(
                f"node {first.node.name!r}: cannot choose a port for the rendezvous: {got.stderr.strip()[-300:]}",
                first.node.name,
            )
        port = int(words[-1])
    try:
        return Rendezvous(host, port, launch_id, job.rendezvous_timeout_s)
    except ValueError as exc:
        raise LaunchError(f"node {first.node.name!r}: {exc}; give its `address`", first.node.name) from None


def _start(
    agents: Sequence[_Agent],
    job: TorchrunJob,
    launch_id: str,
    rendezvous: Rendezvous | None,
    out_dir: Path,
    on_line: LineCallback | None,
    say: Callable[[str], None],
) -> None:
    """Write the request, then start every agent (as tasks; `_wait` follows them)."""
    commands: list[str] = []
    for agent in agents:
        assert agent.temp_dir is not None
        request_path = f"{agent.temp_dir}/{REQUEST_FILE}"
        argv = torchrun_argv(
            agent.node.python,
            job.worker,
            request_path,
            nproc_per_node=job.nproc_per_node,
            nnodes=len(agents),
            rendezvous=rendezvous,
            is_host=(agent.index == 0) if rendezvous is not None else None,
            local_addr=agent.node.address,
        )
        commands.append(f"# node {agent.node.name}\n{' '.join(argv)}")
        agent.task = asyncio.ensure_future(_run_agent(agent, job, launch_id, argv, request_path, out_dir, on_line))
    atomic_write_text(out_dir / "command.txt", "\n".join(commands) + "\n")
    where = f" (rendezvous {rendezvous.endpoint})" if rendezvous is not None else ""
    say(f"{launch_id}: starting {len(agents)} torchrun agent(s) x {job.nproc_per_node} process(es){where}")


async def _run_agent(
    agent: _Agent,
    job: TorchrunJob,
    launch_id: str,
    argv: list[str],
    request_path: str,
    out_dir: Path,
    on_line: LineCallback | None,
) -> JobOutcome:
    """Put the request on the node, then run its agent to the end (killed as a group when cancelled)."""
    assert agent.temp_dir is not None
    local_request = out_dir / f"{agent.log_stem}.{REQUEST_FILE}"
    write_request(local_request, launch_id, f"{agent.temp_dir}/{RESULT_FILE}", job.payload)
    await agent.session.put(local_request, request_path)

    def line(stream: str, text: str) -> None:
        if stream == "stderr" and text.startswith(AGENT_STARTED):
            agent.started = True
        if on_line is not None:
            on_line(stream, f"[{agent.node.name}] {text}")

    script = agent_script(argv, launch_id, setup=agent.node.setup, env=job.env)
    return await agent.session.run(
        script,
        stdout_path=out_dir / f"{agent.log_stem}.stdout.log",
        stderr_path=out_dir / f"{agent.log_stem}.stderr.log",
        on_line=line,
    )


async def _wait(
    agents: Sequence[_Agent], job: TorchrunJob, rendezvous: Rendezvous | None, launch_id: str, began: float
) -> float:
    """Until every agent succeeded (the seconds it took them all to start), or the first failure or the timeout."""
    tasks = {a.task: a for a in agents if a.task is not None}
    pending = set(tasks)
    launched = time.monotonic()
    start_s: float | None = None
    while pending:
        remaining = None if job.timeout_s is None else job.timeout_s - (time.monotonic() - launched)
        if remaining is not None and remaining <= 0:
            await _stop(agents)
            assert job.timeout_s is not None
            raise timeout_error([_state(a) for a in agents], launch_id, job.timeout_s)
        step = 0.2 if start_s is None or remaining is None else min(remaining, 0.2)
        done, pending = await asyncio.wait(pending, timeout=step, return_when=asyncio.FIRST_COMPLETED)
        if start_s is None and all(a.started for a in agents):
            start_s = round(time.monotonic() - began, 3)
        failed = False
        for task in done:
            tasks[task].outcome = task.result()
            failed = failed or not task.result().ok
        if failed:
            if rendezvous is not None and any(_state(a).rendezvous for a in agents):
                await _settle(agents, rendezvous)
            await _stop(agents)
            raise explain_failure([_state(a) for a in agents], rendezvous)
    return start_s if start_s is not None else round(time.monotonic() - began, 3)


async def _settle(agents: Sequence[_Agent], rendezvous: Rendezvous) -> None:
    """After one agent's rendezvous failed, let the other started agents end on their own (their rendezvous is
    bounded by the same timeouts), so the error can say which node could not reach the store."""
    running = {a.task: a for a in agents if a.task is not None and not a.task.done() and a.started}
    if running:
        await asyncio.wait(set(running), timeout=rendezvous.timeout_s + 10.0)
    for task, agent in running.items():
        if task.done() and not task.cancelled():
            agent.outcome = task.result()


async def _stop(agents: Sequence[_Agent]) -> None:
    """Cancel every agent still running: each session kills its process group."""
    running = [a.task for a in agents if a.task is not None and not a.task.done()]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


def _state(agent: _Agent) -> AgentState:
    """What is known of an agent: started, ended, why, and the end of its output."""
    outcome = agent.outcome
    if outcome is None:
        return AgentState(agent.node.name, agent.started, ended=False, ok=False)
    text = ""
    with contextlib.suppress(OSError):
        text = outcome.stderr_path.read_text(errors="replace")[-64 * 1024 :]
    return AgentState(
        agent.node.name,
        agent.started,
        ended=True,
        ok=outcome.ok,
        reason=outcome.reason,
        rendezvous=rendezvous_failure(text),
        tail=tail_text(outcome.stderr_path),
    )


async def _fetch_result(agents: Sequence[_Agent], out_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Rank 0's result, from whichever node rank 0 ran on (the rendezvous, not the node order, decides that)."""
    for agent in agents:
        remote = f"{agent.temp_dir}/{RESULT_FILE}"
        if await agent.session.exists(remote):
            local = await agent.session.fetch(remote, out_dir / RESULT_FILE)
            return local, read_result(local, f"node {agent.node.name!r}")
    raise LaunchError(
        "every agent succeeded but rank 0 wrote no result file; the worker must call launch_worker.write_result"
    )


async def _cleanup(agents: Sequence[_Agent], launch_id: str, say: Callable[[str], None]) -> None:
    """Stop what still runs, sweep every reachable node for the job's processes, remove temp dirs, disconnect."""
    await _stop(agents)

    async def one(agent: _Agent) -> None:
        try:
            if agent.task is not None:  # an agent ran here: end whatever of the job outlived its process group
                script = sweep_script(launch_id, SWEEP_GRACE_S)
                got = await agent.session.capture(script, timeout=SWEEP_GRACE_S * 2 + 30)
                counts = parse_sweep(got.stdout)
                if counts is None:
                    say(f"{launch_id}: node {agent.node.name!r}: the sweep did not run: {got.stderr.strip()[-200:]}")
                elif counts[0]:
                    left = f"ended {counts[0]} leftover process(es), {counts[1]} left"
                    say(f"{launch_id}: node {agent.node.name!r}: {left}")
            if agent.temp_dir is not None:
                await agent.session.remove_temp_dir(agent.temp_dir)
        except RemoteError as exc:  # a node that died or dropped its connection: nothing to reach there
            say(f"{launch_id}: node {agent.node.name!r}: clean-up skipped: {exc}")
        finally:
            await agent.session.close()

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(one(a) for a in agents), return_exceptions=True), CLEANUP_TIMEOUT_S)
