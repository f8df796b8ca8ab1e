"""Run a job through Slurm from a login node (over SSH, or this machine): `sbatch` an allocation whose batch
script starts one torchrun agent per node with `srun`, follow it with `squeue`, fetch rank 0's result.

The login node is probed first (Python, torch, this package, the Slurm commands); the compute nodes run the same
`python` and `setup:` lines, reading the request from the job directory, which must be on storage they share with
the login node. A job still pending after `schedule_timeout_s` is cancelled with squeue's reason in the error; a
failed job names the node srun reports; cancel and timeout `scancel` the job and wait until Slurm has ended it
on every node. The result is read only after the job COMPLETED with exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    new_launch_id,
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
from axrl_spike_replay.remote.launchers.slurm_command import (
    BATCH_FILE,
    JobStatus,
    SlurmSettings,
    batch_script,
    failed_node,
    hostnames_argv,
    job_dir_script,
    parse_job_id,
    parse_sacct,
    parse_scontrol,
    parse_squeue,
    sacct_argv,
    sbatch_argv,
    scancel_argv,
    scontrol_argv,
    squeue_argv,
)
from axrl_spike_replay.remote.nodes.node_probe import probe
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.job import Captured, LineCallback, Session
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.transport.remote_errors import RemoteError
from axrl_spike_replay.remote.transport.shell import bash_command, job_script, quote_argv

SLURM_COMMANDS = ("sbatch", "squeue", "scancel", "scontrol")
CANCEL_WAIT_S = 120.0  # scancel, then until Slurm no longer runs the job (KillWait is 30 s by default)


@dataclass(frozen=True)
class SlurmJob:
    """A job for Slurm: the login node it is submitted from, what to ask for, and what each worker runs."""

    login: LaunchNode
    worker: WorkerEntry
    settings: SlurmSettings = field(default_factory=SlurmSettings)
    payload: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None  # the run, from the job starting on its nodes
    env: Mapping[str, str] = field(default_factory=dict)  # exported for the agents and their workers
    # path -> size the login node must see (the snapshot; the compute nodes' workers check it themselves)
    shared_files: Mapping[str, int] = field(default_factory=dict)


class SlurmLauncher(Launcher[SlurmJob]):
    """`sbatch` from a login node: the batch script starts one torchrun agent per allocated node with `srun`."""

    name = "slurm"

    def dry_run(self, job: SlurmJob) -> DryRun:
        """The `sbatch` command line on the login node and the batch script it submits (the job dir and the job's
        id are made at launch)."""
        launch_id = new_launch_id()
        job_dir = f"{job.settings.job_dir}/JOB_DIR"
        script = batch_script(
            job.settings,
            job.login.python,
            job.worker,
            f"{job_dir}/{REQUEST_FILE}",
            launch_id,
            setup=job.login.setup,
            env=job.env,
        )
        submit = f"# Slurm login node: {job.login.name}\n{quote_argv(sbatch_argv(job.settings, job_dir, launch_id))}"
        notes = (
            f"JOB_DIR: a fresh directory under {job.settings.job_dir} (on storage the compute nodes share)",
            f"{launch_id}: an example of the job's id; each launch gets a fresh one",
        )
        where = f"Slurm from {job.login.name} ({_asked(job.settings)})"
        processes = job.settings.nodes * job.settings.processes_per_node
        return DryRun(self.name, where, processes, (submit, f"# {BATCH_FILE}\n{script}"), notes)

    async def run(
        self,
        job: SlurmJob,
        out_dir: Path,
        status: LaunchStatus,
        *,
        progress: Callable[[str], None],
        on_line: LineCallback | None = None,
    ) -> LaunchOutcome:
        """Submit `job`, wait for it, bring rank 0's result to `out_dir`. LaunchError names the node or partition."""
        launch_id, say = status.launch_id, progress
        began = time.monotonic()
        login = job.login
        session = await self.open_node(login, "Slurm login node")
        job_dir: str | None = None
        live: str | None = None  # the job id while Slurm may still run it
        try:
            await _check_login(session, job)
            job_dir = await _make_job_dir(session, job)
            job_id = live = status.job_id = await _submit(session, job, job_dir, launch_id, out_dir)
            status.state = "pending"
            say(f"{launch_id}: Slurm job {job_id} submitted from {login.name} ({_asked(job.settings)})")
            slurm_status, start_s = await _follow(session, job, job_id, began, say, status)
            live = None
            if not slurm_status.succeeded:
                raise await _failure(session, job, job_id, job_dir, slurm_status, out_dir)
            remote = f"{job_dir}/{RESULT_FILE}"
            if not await session.exists(remote):
                raise LaunchError(f"Slurm job {job_id} completed but rank 0 wrote no result file ({remote})")
            result_path = await session.fetch(remote, out_dir / RESULT_FILE)
            result = read_result(result_path, f"Slurm job {job_id}")
            logs = await _fetch_output(session, job_dir, job_id, out_dir)
            nodes = await _hostnames(session, login, slurm_status.nodes)
        except BaseException:
            await run_to_completion(_end(session, job, live, job_dir, out_dir, say))
            raise
        await run_to_completion(_end(session, job, None, job_dir, out_dir, say))
        return LaunchOutcome(
            launcher=self.name,
            launch_id=launch_id,
            nodes=nodes,
            result=result,
            result_path=result_path,
            out_dir=out_dir,
            seconds=elapsed(began),
            start_s=start_s,
            job_id=job_id,
            logs=logs,
        )


async def launch_slurm(
    job: SlurmJob,
    out_dir: Path,
    *,
    options: RemoteOptions | None = None,
    launch_id: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> LaunchOutcome:
    """Submit `job`, wait for it, bring rank 0's result to `out_dir`. LaunchError names the node or partition."""
    return await SlurmLauncher(options).launch(job, out_dir, launch_id=launch_id, progress=progress)


async def _run(session: Session, login: LaunchNode, argv: Sequence[str], timeout: float = 60.0) -> Captured:
    """A Slurm command on the login node, after the node's setup lines (which may load Slurm's environment)."""
    return await session.capture(bash_command(job_script(argv, setup=login.setup)), timeout=timeout)


async def _hostnames(session: Session, login: LaunchNode, nodelist: str) -> tuple[str, ...]:
    """The host names of a Slurm node list (`gpu-[017-018]` -> gpu-017, gpu-018), as scontrol expands it."""
    if not nodelist:
        return ()
    got = await _run(session, login, hostnames_argv(nodelist))
    names = tuple(got.stdout.split()) if got.exit_status == 0 else ()
    return names or (nodelist,)


async def _check_login(session: Session, job: SlurmJob) -> None:
    """The login node runs the job's Python with torch and this package, and has Slurm's commands."""
    login = job.login
    report = await probe(session, python=login.python, setup=login.setup, import_torch=False)
    check_node_ready(report, login.name, python=login.python, where="Slurm login node")
    lookup = " && ".join(f"command -v {name}" for name in SLURM_COMMANDS)
    got = await session.capture(bash_command(job_script(lookup, setup=login.setup)))
    if got.exit_status != 0:
        found = {line.rsplit("/", 1)[-1] for line in got.stdout.split()}
        missing = [name for name in SLURM_COMMANDS if name not in found]
        raise LaunchError(
            f"Slurm login node {login.name!r}: {', '.join(missing)} not found; is it a Slurm login node? "
            "Add what loads Slurm's environment to the target's `setup:` lines",
            node=login.name,
        )
    if job.shared_files:
        unseen = await shared_files_seen(session, job.shared_files, login.name, report.hostname, "Slurm login node")
        if unseen is not None:
            raise unseen


async def _make_job_dir(session: Session, job: SlurmJob) -> str:
    got = await session.capture(bash_command(job_dir_script(job.settings.job_dir)))
    path = got.stdout.strip().splitlines()[-1] if got.stdout.strip() else ""
    if got.exit_status != 0 or not path.startswith("/"):
        raise LaunchError(
            f"Slurm login node {job.login.name!r}: cannot create a job directory under {job.settings.job_dir}: "
            f"{got.stderr.strip()[-300:]}; set `job_dir` to a directory on storage the compute nodes share",
            node=job.login.name,
        )
    return path


async def _submit(session: Session, job: SlurmJob, job_dir: str, launch_id: str, out_dir: Path) -> str:
    """Put the request and batch script in the job dir, then `sbatch`; its refusal is the error."""
    request = out_dir / REQUEST_FILE
    write_request(request, launch_id, f"{job_dir}/{RESULT_FILE}", job.payload)
    script = batch_script(
        job.settings,
        job.login.python,
        job.worker,
        f"{job_dir}/{REQUEST_FILE}",
        launch_id,
        setup=job.login.setup,
        env=job.env,
    )
    atomic_write_text(out_dir / BATCH_FILE, script)
    await session.put(request, f"{job_dir}/{REQUEST_FILE}")
    await session.put(out_dir / BATCH_FILE, f"{job_dir}/{BATCH_FILE}")
    argv = sbatch_argv(job.settings, job_dir, launch_id)
    atomic_write_text(out_dir / "command.txt", f"# Slurm login node: {job.login.name}\n{quote_argv(argv)}\n")
    got = await _run(session, job.login, argv)
    job_id = parse_job_id(got.stdout)
    if got.exit_status != 0 or job_id is None:
        said = " ".join((got.stderr.strip() or got.stdout.strip()).split())[-500:]
        raise LaunchError(
            f"Slurm refused the job ({_asked(job.settings)}) on {job.login.name!r}: {said or 'sbatch printed nothing'}",
            node=job.login.name,
        )
    return job_id


async def _status(session: Session, login: LaunchNode, job_id: str) -> JobStatus | None:
    """squeue while it lists the job; then scontrol, then sacct (None: Slurm does not know the job)."""
    got = await _run(session, login, squeue_argv(job_id))
    status = parse_squeue(got.stdout) if got.exit_status == 0 else None
    if status is not None and (status.pending or status.running):
        return status
    got = await _run(session, login, scontrol_argv(job_id))
    final = parse_scontrol(got.stdout) if got.exit_status == 0 else None
    if final is None:
        got = await _run(session, login, sacct_argv(job_id))
        final = parse_sacct(got.stdout) if got.exit_status == 0 else None
    return final or status


async def _follow(
    session: Session, job: SlurmJob, job_id: str, began: float, say: Callable[[str], None], launch: LaunchStatus
) -> tuple[JobStatus, float]:
    """Poll until the job ended: its final status and the seconds until it started running."""
    settings, submitted = job.settings, time.monotonic()
    running_since: float | None = None
    unknown = hopeless = 0
    while True:
        status = await _status(session, job.login, job_id)
        now = time.monotonic()
        unknown = unknown + 1 if status is None else 0
        if unknown >= 3:  # a moment after submission squeue may not list it yet; not three times in a row
            raise LaunchError(f"Slurm job {job_id} is unknown to squeue, scontrol and sacct on {job.login.name!r}")
        if status is None:
            pass
        elif status.pending:
            hopeless = hopeless + 1 if status.hopeless else 0
            if hopeless >= 2 or now - submitted > settings.schedule_timeout_s:
                raise _unscheduled(job, job_id, status, hopeless >= 2)
        elif status.running:
            if running_since is None:
                running_since = now
                launch.state = "running"
                say(f"Slurm job {job_id} running on {status.nodes or '?'}")
            if job.timeout_s is not None and now - running_since > job.timeout_s:
                raise LaunchError(
                    f"Slurm job {job_id} on {status.nodes or '?'} did not finish within {job.timeout_s:g} s; "
                    "it was cancelled (scancel) on every node",
                    node=status.nodes or None,
                    timed_out=True,
                )
        else:
            start = running_since if running_since is not None else now
            return status, round(start - began, 3)
        await asyncio.sleep(settings.poll_s)


def _unscheduled(job: SlurmJob, job_id: str, status: JobStatus, hopeless: bool) -> LaunchError:
    """The error for a job Slurm did not start: it waited too long, or for a reason that waiting does not clear."""
    settings = job.settings
    partition = settings.partition or "(the default partition)"
    said = f"squeue says {status.state}, reason {status.reason or 'none given'}"
    if hopeless:
        head = f"Slurm job {job_id} cannot be scheduled on partition {partition} ({_asked(settings)}): {said}"
        hint = "the partition, account or QOS cannot give what it asks; ask for less, or another partition"
    else:
        head = (
            f"Slurm job {job_id} was not scheduled within {settings.schedule_timeout_s:g} s on partition {partition} "
            f"({_asked(settings)}): {said}"
        )
        hint = "ask for fewer nodes, GPUs or time, another partition, or a longer `schedule_timeout_s`"
    return LaunchError(f"{head}. It was cancelled (scancel {job_id}); {hint}", node=job.login.name)


async def _failure(
    session: Session, job: SlurmJob, job_id: str, job_dir: str, status: JobStatus, out_dir: Path
) -> LaunchError:
    """The error for a job that ended without success: its state, the node srun names, its output's end."""
    logs = await _fetch_output(session, job_dir, job_id, out_dir)
    output = logs.get("slurm")
    text = ""
    if output is not None:
        with contextlib.suppress(OSError):
            text = output.read_text(errors="replace")[-256 * 1024 :]
    node = failed_node(text) or (status.nodes if status.nodes and "," not in status.nodes else None)
    where = f" on node {node!r}" if node else ""
    exit_code = f", exit code {status.exit_code}" if status.exit_code else ""
    return LaunchError(
        f"Slurm job {job_id} failed{where}: {status.state}{exit_code}. Its output ends: "
        f"{(tail_text(output) if output else '') or '(nothing)'}",
        node=node,
    )


async def _fetch_output(session: Session, job_dir: str, job_id: str, out_dir: Path) -> dict[str, Path]:
    """The job's output file (stdout and stderr of the batch script and every agent), when there is one."""
    remote = f"{job_dir}/slurm-{job_id}.out"
    with contextlib.suppress(RemoteError):
        if await session.exists(remote):
            return {"slurm": await session.fetch(remote, out_dir / f"slurm-{job_id}.out")}
    return {}


async def _end(
    session: Session,
    job: SlurmJob,
    job_id: str | None,
    job_dir: str | None,
    out_dir: Path,
    say: Callable[[str], None],
) -> None:
    """Cancel the job (when given) and wait until Slurm has ended it; keep its output; remove the job dir."""
    try:
        if job_id is not None:
            await _cancel(session, job.login, job_id, say)
            if job_dir is not None:
                await _fetch_output(session, job_dir, job_id, out_dir)
        if job_dir is not None:
            await session.remove_temp_dir(job_dir)
    except RemoteError as exc:
        say(f"clean-up on {job.login.name!r} incomplete: {exc}")
    finally:
        await session.close()


async def _cancel(session: Session, login: LaunchNode, job_id: str, say: Callable[[str], None]) -> None:
    """`scancel`, then poll until the job no longer runs anywhere (bounded by CANCEL_WAIT_S)."""
    await _run(session, login, scancel_argv(job_id))
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        got = await _run(session, login, squeue_argv(job_id))
        status = parse_squeue(got.stdout) if got.exit_status == 0 else None
        if status is None or not (status.pending or status.running):
            say(f"Slurm job {job_id} cancelled")
            return
        await asyncio.sleep(0.5)
    say(f"Slurm job {job_id} still listed by squeue {CANCEL_WAIT_S:g} s after scancel")


def _asked(settings: SlurmSettings) -> str:
    parts = [f"partition {settings.partition or '(default)'}", f"{settings.nodes} node(s)"]
    if settings.gpus_per_node:
        parts.append(f"{settings.gpus_per_node} GPU(s) per node")
    if settings.cpus_per_task:
        parts.append(f"{settings.cpus_per_task} CPU(s) per node")
    if settings.account:
        parts.append(f"account {settings.account}")
    if settings.time:
        parts.append(f"time {settings.time}")
    return ", ".join(parts)
