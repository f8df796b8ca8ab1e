"""Slurm command lines and their output: the allocation a job asks for (`sbatch`), the batch script that runs one
torchrun agent per allocated node (`srun … python -m torch.distributed.run …`, rendezvous on the allocation's first
node), and what `squeue`, `scontrol` and `sacct` say about the job.

Every word is quoted when sent; the settings are checked before they reach a command line.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.launchers.launch_job import LAUNCH_ID_ENV, WorkerEntry, check_launch_id
from axrl_spike_replay.remote.launchers.torchrun_command import DEFAULT_RENDEZVOUS_TIMEOUT_S, torchrun_argv
from axrl_spike_replay.remote.transport.shell import job_script

DEFAULT_JOB_DIR = "~/.axrl-spike-replay/slurm-jobs"
BATCH_FILE = "batch.sh"
OUTPUT_PATTERN = "slurm-%j.out"
RENDEZVOUS_MARK = "@@axrl-slurm rendezvous"
NO_HEAD_STATUS = 98
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # partition, account, QOS names
_TIME_RE = re.compile(r"(\d+-)?\d+(:\d+){0,2}|\d+-\d+")  # minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
_FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
_ENDPOINT_WORD = "@AXRL_RDZV_ENDPOINT@"  # stands for the endpoint the batch script computes
_NNODES_WORD = "@AXRL_NNODES@"  # the allocation's node count, known in the batch script
_NNODES_FLAG = "@AXRL_SRUN_NODES@"
PENDING_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
# Pending reasons that do not clear by waiting (the request exceeds what the partition, account or QOS allows)
HOPELESS_REASONS = {
    "AccountNotAllowed",
    "BadConstraints",
    "DependencyNeverSatisfied",
    "InvalidAccount",
    "InvalidQOS",
    "PartitionConfig",
    "PartitionTimeLimit",
    "QOSNotAllowed",
}
RUNNING_STATES = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"}


@dataclass(frozen=True)
class SlurmSettings:
    """What to ask Slurm for, and how long to wait: from `spike-replay.yaml` or arguments."""

    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    time: str | None = None  # sbatch --time: minutes, HH:MM:SS or D-HH:MM:SS
    nodes: int = 1
    gpus_per_node: int | None = None
    nproc_per_node: int | None = None  # torchrun processes per node; default: gpus_per_node, else 1
    cpus_per_task: int | None = None  # CPUs for each node's agent and its workers
    job_dir: str = DEFAULT_JOB_DIR  # on storage every compute node sees (`~/` is the login node's home)
    sbatch_args: tuple[str, ...] = ()  # further sbatch options, e.g. ("--qos=high", "--constraint=h100")
    schedule_timeout_s: float = 1800.0  # a job still pending after this is cancelled, with squeue's reason
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    poll_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("partition", "account"):
            value = getattr(self, name)
            if value is not None and not _NAME_RE.fullmatch(value):
                raise ConfigError(f"slurm `{name}` {value!r}: use letters, digits and . _ + -", name)
        if self.time is not None and not _TIME_RE.fullmatch(self.time):
            raise ConfigError(f"slurm `time` {self.time!r}: give minutes, HH:MM:SS or D-HH:MM:SS", "time")
        for name in ("nodes", "gpus_per_node", "nproc_per_node", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"slurm `{name}` must be a whole number of at least 1, got {value!r}", name)
        if not self.job_dir.strip() or "%" in self.job_dir or "\n" in self.job_dir:
            raise ConfigError(f"slurm `job_dir` {self.job_dir!r}: a directory path without % or line breaks", "job_dir")
        for arg in self.sbatch_args:
            if not arg.startswith("--") or "\n" in arg:
                raise ConfigError(f"slurm `sbatch_args`: {arg!r} is not a long sbatch option (--name=value)")
        for name in ("schedule_timeout_s", "rendezvous_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"slurm `{name}` must be a positive number of seconds", name)

    @property
    def processes_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1


@dataclass(frozen=True)
class JobStatus:
    """A job's state as Slurm reports it (squeue while it is known there, then scontrol or sacct)."""

    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ... ("" when Slurm no longer knows it)
    reason: str = ""  # why it is pending (squeue's %r), or how it ended
    nodes: str = ""  # the node list
    exit_code: str = ""  # scontrol/sacct "status:signal"

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    @property
    def hopeless(self) -> bool:
        """Pending for a reason that waiting does not clear (e.g. more CPUs than any node of the partition has)."""
        return self.pending and self.reason in HOPELESS_REASONS

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code in ("", "0:0")


def job_dir_script(job_dir: str) -> str:
    """Shell text making a private directory for one job under `job_dir` (created if missing); prints its path."""
    if job_dir == "~" or job_dir.startswith("~/"):
        base = '"$HOME"' + (f"/{shlex.quote(job_dir[2:])}" if job_dir[2:] else "")
    else:
        base = shlex.quote(job_dir)
    return f'_base={base}\nmkdir -p -- "$_base" && mktemp -d "$_base/axrl-slurm-XXXXXXXX"\n'


def sbatch_argv(settings: SlurmSettings, job_dir: str, launch_id: str) -> list[str]:
    """`sbatch` for the job's batch script in `job_dir`: one task per node, output kept in the job dir."""
    check_launch_id(launch_id)
    argv = ["sbatch", "--parsable", f"--job-name={launch_id}", f"--chdir={job_dir}"]
    argv += [f"--output={job_dir}/{OUTPUT_PATTERN}", f"--nodes={settings.nodes}", "--ntasks-per-node=1"]
    if settings.partition:
        argv.append(f"--partition={settings.partition}")
    if settings.account:
        argv.append(f"--account={settings.account}")
    if settings.time:
        argv.append(f"--time={settings.time}")
    if settings.gpus_per_node:
        argv.append(f"--gpus-per-node={settings.gpus_per_node}")
    if settings.cpus_per_task:
        argv.append(f"--cpus-per-task={settings.cpus_per_task}")
    return [*argv, *settings.sbatch_args, f"{job_dir}/{BATCH_FILE}"]


def batch_script(
    settings: SlurmSettings,
    python: str,
    worker: WorkerEntry,
    request_path: str,
    launch_id: str,
    *,
    setup: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> str:
    """The batch script: setup lines, the job's tag, the rendezvous endpoint on the allocation's first node, then
    `srun` starting one torchrun agent per node (`--kill-on-bad-exit`: one failed node ends them all)."""
    argv = torchrun_argv(
        python,
        worker,
        request_path,
        nproc_per_node=settings.processes_per_node,
        nnodes=_NNODES_WORD,
        endpoint=_ENDPOINT_WORD,
        run_id=launch_id,
        timeout_s=settings.rendezvous_timeout_s,
    )
    srun = ["srun", _NNODES_FLAG, "--ntasks-per-node=1", "--kill-on-bad-exit=1", *argv]
    raw = {
        _ENDPOINT_WORD: '"$_axrl_endpoint"',
        _NNODES_WORD: '"$SLURM_JOB_NUM_NODES"',
        _NNODES_FLAG: '--nodes="$SLURM_JOB_NUM_NODES"',
    }
    lines = [
        '_axrl_head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'[ -n "$_axrl_head" ] || {{ echo "no first node in SLURM_JOB_NODELIST" >&2; exit {NO_HEAD_STATUS}; }}',
        f"_axrl_port=$({shlex.quote(python)} -c {shlex.quote(_FREE_PORT)}) || exit {NO_HEAD_STATUS}",
        '_axrl_endpoint="$_axrl_head:$_axrl_port"',
        f'echo "{RENDEZVOUS_MARK} $_axrl_endpoint on $SLURM_JOB_NODELIST" >&2',
        "exec " + " ".join(raw.get(word, shlex.quote(word)) for word in srun),
    ]
    body = job_script("\n".join(lines), setup=setup, env={**(env or {}), LAUNCH_ID_ENV: launch_id})
    return f"#!/bin/bash\n# {launch_id}: one torchrun agent per node of this allocation (axrl-spike-replay)\n{body}"


def parse_job_id(sbatch_stdout: str) -> str | None:
    """The job id `sbatch --parsable` printed (`ID` or `ID;CLUSTER`), None when there is none."""
    for line in reversed(sbatch_stdout.strip().splitlines()):
        word = line.strip().split(";")[0]
        if word.isdigit():
            return word
    return None


def squeue_argv(job_id: str) -> list[str]:
    """`squeue` for one job: state, pending reason, node list."""
    return ["squeue", "-h", "-j", _job(job_id), "-o", "%T|%r|%N"]


def parse_squeue(stdout: str) -> JobStatus | None:
    """The job's status from `squeue_argv` output, None when squeue no longer lists it."""
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            return JobStatus(state=parts[0], reason=parts[1], nodes=parts[2])
    return None


def scontrol_argv(job_id: str) -> list[str]:
    """`scontrol show job` for one job, on one line."""
    return ["scontrol", "show", "job", "-o", _job(job_id)]


def parse_scontrol(stdout: str) -> JobStatus | None:
    """The job's final status from `scontrol show job -o` (None when it no longer knows the job)."""
    state = re.search(r"\bJobState=(\S+)", stdout)
    if state is None:
        return None

    def field(name: str) -> str:
        found = re.search(rf"\b{name}=(\S+)", stdout)
        return found.group(1) if found and found.group(1) != "(null)" else ""

    return JobStatus(state=state.group(1), reason=field("Reason"), nodes=field("NodeList"), exit_code=field("ExitCode"))


def sacct_argv(job_id: str) -> list[str]:
    """`sacct` for the job's allocation (where scontrol has forgotten the job)."""
    return ["sacct", "-X", "-n", "-P", "-j", _job(job_id), "-o", "State,ExitCode,NodeList,Reason"]


def parse_sacct(stdout: str) -> JobStatus | None:
    """The job's final status from `sacct_argv` output (None when accounting does not know it)."""
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            state = parts[0].split()[0]  # "CANCELLED by 0" -> CANCELLED
            return JobStatus(state=state, exit_code=parts[1], nodes=parts[2], reason=parts[3] if parts[3:] else "")
    return None


def scancel_argv(job_id: str) -> list[str]:
    """`scancel` for the job: every step on every node is signalled, then killed after the cluster's KillWait."""
    return ["scancel", _job(job_id)]


def hostnames_argv(nodelist: str) -> list[str]:
    """`scontrol show hostnames` expanding a node list (its text is one quoted word)."""
    return ["scontrol", "show", "hostnames", nodelist]


def failed_node(output: str) -> str | None:
    """The node srun reports a failed task on (`srun: error: NODE: task N: Exited with exit code X`), if any."""
    found = re.search(r"srun: error: ([A-Za-z0-9._-]+): tasks? [0-9,-]+: ", output)
    return found.group(1) if found else None


def _job(job_id: str) -> str:
    if not job_id.isdigit():
        raise ValueError(f"Slurm job id {job_id!r} is not a number")
    return job_id
