"""A one-node Slurm cluster on loopback for the launcher tests: Debian's munged, slurmctld and slurmd, started with a
generated `slurm.conf` (this machine's real CPUs and memory, free ports, private state and spool dirs) and stopped
with every process they started.

scripts/slurm-install.sh installs the packages; where they are missing, or the daemons cannot start (not root,
no munge), `start_cluster` raises `SlurmUnavailable` with the reason and the tests skip with it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "srun", "squeue", "scancel", "scontrol")
PARTITION = "loop"
DOWN_PARTITION = "loop-down"  # the same node, but the partition is down: jobs queue and are never scheduled
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why (tests skip with it)."""


@dataclass
class SlurmCluster:
    """A running loopback cluster: where its config is and how to reach it."""

    directory: Path
    conf: Path
    node: str  # this machine's host name, the cluster's only node
    partition: str
    cpus: int
    memory_mib: int
    started_s: float  # seconds from the first daemon's start to the node showing idle
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What a shell needs to talk to this cluster (the client tools read SLURM_CONF)."""
        return {"SLURM_CONF": str(self.conf)}

    @property
    def setup(self) -> tuple[str, ...]:
        """The same as a target's setup line (as a user would source their cluster's environment)."""
        return (f"export SLURM_CONF={shlex.quote(str(self.conf))}",)

    def command(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(
            list(argv), env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout, check=False
        )

    def jobs(self) -> list[str]:
        """`squeue` lines (id and state) of every job still known to the controller as pending or running."""
        got = self.command("squeue", "-h", "-o", "%i %T")
        return [line for line in got.stdout.splitlines() if line.strip()]

    def stop(self) -> list[str]:
        """Stop slurmd, slurmctld and munged (TERM, then KILL); the leftover steps' command lines, if any."""
        for job in self.jobs() if self.processes and self.processes[-1].poll() is None else []:
            self.command("scancel", job.split()[0])
        for process in reversed(self.processes):
            _terminate(process)
        self.processes.clear()
        return leftover_steps(self.directory)

    def log(self, name: str) -> str:
        """A daemon's log (slurmctld, slurmd or munged), for failure messages."""
        path = self.directory / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def missing_binaries() -> list[str]:
    """The Slurm and munge programs not installed here."""
    search = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [name for name in BINARIES if shutil.which(name, path=search) is None]


def node_hardware() -> tuple[int, int]:
    """(CPUs, RealMemory MiB) of this machine as slurmd itself counts them (`slurmd -C`)."""
    got = subprocess.run([_binary("slurmd"), "-C"], capture_output=True, text=True, timeout=30, check=False)
    cpus = re.search(r"\bCPUs=(\d+)", got.stdout)
    memory = re.search(r"\bRealMemory=(\d+)", got.stdout)
    if got.returncode != 0 or cpus is None or memory is None:
        raise SlurmUnavailable(f"`slurmd -C` did not report this machine's CPUs and memory: {got.stderr.strip()}")
    # A little less memory than the node has: slurmd drains a node whose RealMemory exceeds what it finds.
    return int(cpus.group(1)), max(1, int(memory.group(1)) * 95 // 100)


def slurm_conf(directory: Path, node: str, cpus: int, memory_mib: int, ports: tuple[int, int]) -> str:
    """The cluster's slurm.conf: one node on 127.0.0.1, no cgroups, no accounting database, private paths."""
    ctld_port, slurmd_port = ports
    state, spool, log, run = (directory / name for name in ("state", "spool", "log", "run"))
    return "\n".join(
        [
            "ClusterName=axrl-loop",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={directory / 'munge' / 'munge.socket.2'}",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={spool}/%n",
            f"SlurmctldPidFile={run}/slurmctld.pid",
            f"SlurmdPidFile={run}/slurmd-%n.pid",
            f"SlurmctldLogFile={log}/slurmctld.log",
            f"SlurmdLogFile={log}/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",  # no cgroups needed: processes are tracked by parentage
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job` for the whole test session
            "MessageTimeout=10",
            f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs={cpus} RealMemory={memory_mib} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=60 State=UP",
            f"PartitionName={DOWN_PARTITION} Nodes={node} MaxTime=60 State=DOWN",
            "",
        ]
    )


def start_cluster(directory: Path, timeout: float = START_TIMEOUT_S) -> SlurmCluster:
    """Write a munge key and slurm.conf under `directory`, start munged, slurmctld and slurmd, wait for idle."""
    missing = missing_binaries()
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (scripts/slurm-install.sh installs slurm-wlm)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd must run as root to start jobs as the test user; the tests run unprivileged")
    started = time.monotonic()
    node = socket.gethostname().split(".")[0]
    cpus, memory = node_hardware()
    for name in ("munge", "state", "spool", "log", "run"):
        (directory / name).mkdir(parents=True, exist_ok=True)
    os.chmod(directory / "munge", 0o700)
    key = directory / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    conf = directory / "slurm.conf"
    conf.write_text(slurm_conf(directory, node, cpus, memory, (_free_port(), _free_port())))
    cluster = SlurmCluster(directory, conf, node, PARTITION, cpus, memory, 0.0)
    env = {**os.environ, **cluster.env}
    log = directory / "log"
    try:
        munge = directory / "munge"
        cluster.processes.append(
            _spawn(
                [
                    _binary("munged"),
                    "--foreground",
                    "--force",  # tolerate a world-writable ancestor of the temp dir (/tmp)
                    f"--socket={munge / 'munge.socket.2'}",
                    f"--key-file={key}",
                    f"--pid-file={munge / 'munged.pid'}",
                    f"--seed-file={munge / 'munged.seed'}",
                    f"--log-file={log / 'munged.log'}",
                ],
                env,
                log / "munged.out",
            )
        )
        _wait_for(lambda: (munge / "munge.socket.2").exists(), cluster, "munged", timeout)
        cluster.processes.append(_spawn([_binary("slurmctld"), "-D", "-i"], env, log / "slurmctld.out"))
        cluster.processes.append(_spawn([_binary("slurmd"), "-D", "-N", node], env, log / "slurmd.out"))
        _wait_for(lambda: _node_state(cluster) == "idle", cluster, "the node to show idle in sinfo", timeout)
    except BaseException:
        cluster.stop()
        raise
    cluster.started_s = round(time.monotonic() - started, 2)
    return cluster


def leftover_steps(directory: Path) -> list[str]:
    """Command lines of processes still running that belong to this cluster (its daemons and job steps)."""
    found = subprocess.run(["pgrep", "-af", "slurmstepd|slurmd|slurmctld|munged"], capture_output=True, text=True)
    ours: list[str] = []
    for line in found.stdout.splitlines():
        pid = line.split()[0]
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(directory).encode() in environ + cmdline:
                ours.append(line)
    return ours


def _node_state(cluster: SlurmCluster) -> str:
    got = cluster.command("sinfo", "-h", "-N", "-n", cluster.node, "-p", cluster.partition, "-o", "%T", timeout=15)
    return got.stdout.strip().rstrip("*~#!%$@^-") if got.returncode == 0 else ""


def _wait_for(ready: Callable[[], bool], cluster: SlurmCluster, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for process in cluster.processes:
            if process.poll() is not None:
                name = Path(str(process.args[0])).name  # type: ignore[index]
                raise SlurmUnavailable(
                    f"{name} exited with status {process.returncode} while waiting for {what}: "
                    f"{_tail(cluster.log(name) or (cluster.directory / 'log' / f'{name}.out').read_text())}"
                )
        if time.monotonic() > deadline:
            state = _node_state(cluster)
            raise SlurmUnavailable(
                f"gave up waiting {timeout:g} s for {what} (node state {state or 'unknown'!r}); "
                f"slurmd log: {_tail(cluster.log('slurmd'))} slurmctld log: {_tail(cluster.log('slurmctld'))}"
            )
        time.sleep(0.2)


def _spawn(argv: list[str], env: dict[str, str], out: Path) -> subprocess.Popen:
    with open(out, "wb") as sink:
        return subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def _terminate(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_GRACE_S)


def _binary(name: str) -> str:
    search = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    path = shutil.which(name, path=search)
    if path is None:
        raise SlurmUnavailable(f"{name} is not installed")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])
