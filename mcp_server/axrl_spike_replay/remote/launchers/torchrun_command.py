"""torchrun command lines: one agent per node, the c10d rendezvous they share, and the scripts around them.

Every word is quoted when sent; nothing a user typed is ever pasted into shell text unquoted.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from axrl_spike_replay.remote.launchers.launch_job import LAUNCH_ID_ENV, WorkerEntry, check_launch_id
from axrl_spike_replay.remote.transport.shell import job_script, quote_argv

TORCHRUN_MODULE = "torch.distributed.run"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0  # torchrun's own join timeout is 600 s
AGENT_STARTED = "@@axrl-agent started"
SWEEP_MARK = "@@axrl-sweep"
_FAILURES = {
    "RendezvousTimeoutError": "timeout",
    "RendezvousConnectionError": "connection",
    "RendezvousClosedError": "closed",
}
_FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
_HOST_RE = re.compile(r"[A-Za-z0-9._:%-]+")  # names, IPv4 and IPv6 addresses


def is_host_text(text: str) -> bool:
    """Whether `text` can be a host name or address (it goes into torchrun's words as is)."""
    return bool(_HOST_RE.fullmatch(text)) and not text.startswith("-")


@dataclass(frozen=True)
class Rendezvous:
    """The c10d rendezvous every agent of a job joins: where its store listens, its id and how long to wait."""

    host: str
    port: int
    run_id: str
    timeout_s: float

    def __post_init__(self) -> None:
        if not is_host_text(self.host):
            raise ValueError(f"rendezvous host {self.host!r} is not a host name or address")
        if not 0 < self.port < 65536:
            raise ValueError(f"rendezvous port {self.port} is not from 1 to 65535")
        if not self.timeout_s > 0:
            raise ValueError(f"rendezvous timeout {self.timeout_s!r} must be a positive number of seconds")

    @property
    def endpoint(self) -> str:
        """HOST:PORT as torchrun takes it ([HOST]:PORT for an IPv6 address)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def rendezvous_conf(timeout_s: float, is_host: bool | None = None) -> str:
    """`--rdzv-conf` text: join and store timeouts, and whether this agent hosts the store (None: torchrun decides).

    Saying which agent hosts the store avoids torchrun's guess from host names, which is wrong on multi-homed
    nodes and ambiguous when two agents share a machine.
    """
    seconds = max(1, round(timeout_s))
    conf = f"join_timeout={seconds},read_timeout={max(5, seconds)}"
    return conf if is_host is None else f"{conf},is_host={int(is_host)}"


def torchrun_argv(
    python: str,
    worker: WorkerEntry,
    request_path: str,
    *,
    nproc_per_node: int,
    nnodes: int | str = 1,
    rendezvous: Rendezvous | None = None,
    is_host: bool | None = None,
    endpoint: str | None = None,
    run_id: str | None = None,
    timeout_s: float | None = None,
    local_addr: str | None = None,
) -> list[str]:
    """One torchrun agent's command line.

    One node without a rendezvous runs `--standalone` (torchrun picks a free local port itself). Otherwise every
    agent gets the same c10d endpoint and id; `endpoint`/`run_id`/`timeout_s` stand in for `rendezvous` where the
    endpoint is only known on the node (Slurm's batch script). Group ranks are assigned by the rendezvous, so no
    `--node-rank` is passed (torchrun reads it only for the static backend). `local_addr` is the address the other
    nodes reach this one at; the agent that becomes group rank 0 publishes it as the workers' MASTER_ADDR (torchrun's
    default is the node's FQDN). `--max-restarts 0`: a replay is not
    elastic; a failed worker fails the job at once.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
    argv = [python, "-m", TORCHRUN_MODULE, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
    if rendezvous is not None:
        endpoint, run_id, timeout_s = rendezvous.endpoint, rendezvous.run_id, rendezvous.timeout_s
    if endpoint is None:
        if nnodes != 1:
            raise ValueError("several nodes need a rendezvous endpoint")
        argv.append("--standalone")
    else:
        if run_id is None or timeout_s is None:
            raise ValueError("a rendezvous endpoint needs its run id and timeout")
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
        argv += ["--rdzv-conf", rendezvous_conf(timeout_s, is_host)]
    if local_addr is not None:
        if not is_host_text(local_addr):
            raise ValueError(f"node address {local_addr!r} is not a host name or address")
        argv += ["--local-addr", local_addr]
    argv += ["--max-restarts", "0"]
    return argv + worker.words(request_path)


def agent_script(
    argv: Sequence[str], launch_id: str, *, setup: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> str:
    """The agent's shell script: setup lines, the launch tag in the environment, a start mark, then exec torchrun.

    The mark on stderr tells the launcher the agent got past the node's setup lines (a node that never prints it
    never started its agent); the tag lets a sweep find every process of the job, workers included (torchrun
    puts each worker in a session of its own, out of the agent's process group).
    """
    check_launch_id(launch_id)
    command = f'echo "{AGENT_STARTED} $(uname -n)" >&2\nexec {quote_argv(argv)}'
    return job_script(command, setup=setup, env={**(env or {}), LAUNCH_ID_ENV: launch_id})


def free_port_script(python: str, setup: Sequence[str] = ()) -> str:
    """A script printing a TCP port that is free on the node right now (for the rendezvous store to listen on)."""
    return job_script([python, "-c", _FREE_PORT], setup=setup)


def sweep_script(launch_id: str, grace_s: int = 5) -> str:
    """A POSIX sh script ending every process on the node tagged with `launch_id` (TERM, then KILL after `grace_s`).

    It needs no setup lines and no Python (a hung setup line must not stop the clean-up) and prints
    `@@axrl-sweep FOUND LEFT`: how many tagged processes it found and how many outlived KILL.
    """
    check_launch_id(launch_id)
    script = (
        f"tagged() {{ grep -lzx {shlex.quote(f'{LAUNCH_ID_ENV}={launch_id}')} /proc/[0-9]*/environ 2>/dev/null"
        " | sed -e 's#^/proc/##' -e 's#/environ$##'; }\n"
        "pids=$(tagged)\n"
        "found=$(printf '%s' \"$pids\" | grep -c .)\n"
        "for sig in TERM KILL; do\n"
        '  [ -n "$pids" ] || break\n'
        "  kill -s $sig $pids 2>/dev/null\n"
        "  i=0\n"
        f'  while [ -n "$pids" ] && [ $i -lt {max(1, int(grace_s)) * 10} ]; do\n'
        "    sleep 0.1; i=$((i + 1)); pids=$(tagged)\n"
        "  done\n"
        "done\n"
        f'echo "{SWEEP_MARK} $found $(tagged | grep -c .)"\n'
    )
    return f"sh -c {shlex.quote(script)}"


def parse_sweep(output: str) -> tuple[int, int] | None:
    """(found, left) from a sweep's output, None when it did not run to its end."""
    for line in output.splitlines():
        words = line.split()
        if words[:1] == [SWEEP_MARK] and len(words) == 3 and words[1].isdigit() and words[2].isdigit():
            return int(words[1]), int(words[2])
    return None


def rendezvous_failure(agent_output: str) -> str | None:
    """How an agent's rendezvous failed ("timeout", "connection", "closed"), or None when it did not."""
    for name, kind in _FAILURES.items():
        if name in agent_output:
            return kind
    return None


def shell_line(argv: Sequence[str], raw: Mapping[str, str]) -> str:
    """`argv` as a command line where each word equal to a key of `raw` is replaced by its (unquoted) shell text."""
    return " ".join(raw[word] if word in raw else shlex.quote(word) for word in argv)
