#!/usr/bin/env python3
"""What our launchers add on top of torchrun itself, side by side and interleaved in one run.

The job is the launcher tests' worker (a gloo all-reduce over 2 processes; rank 0 writes the result):

1. one node: bare `torchrun --standalone --nproc-per-node 2` here vs `launch_torchrun` with one local node
   (probe, request, agent, sweep, result fetch);
2. two nodes: two bare torchrun agents here meeting at a c10d rendezvous on 127.0.0.1 vs `launch_torchrun` with
   two nodes over SSH (Debian's OpenSSH sshd on loopback: connect, probe, port, request, agents, sweep, fetch);
3. Slurm (when slurm-wlm and munge are installed and we are root): the loopback cluster's start-up, then
   `launch_slurm` (sbatch → srun → torchrun, 1 node x 2 processes, squeue polled every 0.3 s) vs case 1's bare run.

Usage: .venv/bin/python benchmarks/bench_launchers.py [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "remote"))

from launch_helpers import WORKER, ssh_node  # noqa: E402
from slurm_loopback import SlurmUnavailable, start_cluster  # noqa: E402
from ssh_loopback import SSHD, Keys, LoopbackServer, OpenSshServer, write_known_hosts  # noqa: E402

from axrl_spike_replay.remote.launchers.launch_job import LaunchNode, new_launch_id, request_document  # noqa: E402
from axrl_spike_replay.remote.launchers.slurm_command import SlurmSettings  # noqa: E402
from axrl_spike_replay.remote.launchers.slurm_launch import SlurmJob, launch_slurm  # noqa: E402
from axrl_spike_replay.remote.launchers.torchrun_launch import TorchrunJob, launch_torchrun  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "0"]


def bare_one_node(work: Path) -> float:
    request = _request(work)
    start = time.perf_counter()
    argv = [*TORCHRUN, "--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(WORKER.script), str(request)]
    subprocess.run(argv, check=True, capture_output=True)
    elapsed = time.perf_counter() - start
    assert json.loads((work / "result.json").read_text())["sum"] == 3.0
    return elapsed


def bare_two_agents(work: Path) -> float:
    request = _request(work)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter()
    agents = []
    for host in (1, 0):
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench"]
        rdzv += ["--rdzv-conf", f"join_timeout=60,is_host={host}", "--nnodes", "2", "--nproc-per-node", "1"]
        argv = [*TORCHRUN, *rdzv, str(WORKER.script), str(request)]
        agents.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    assert all(agent.wait() == 0 for agent in agents)
    elapsed = time.perf_counter() - start
    assert json.loads((work / "result.json").read_text())["sum"] == 3.0
    return elapsed


def ours_one_node(work: Path) -> float:
    job = TorchrunJob(nodes=(LaunchNode("here"),), worker=WORKER, nproc_per_node=2, timeout_s=300)
    start = time.perf_counter()
    outcome = asyncio.run(launch_torchrun(job, work / "out"))
    assert outcome.result["sum"] == 3.0
    return time.perf_counter() - start


def ours_two_nodes_ssh(server: LoopbackServer) -> Callable[[Path], float]:
    def run(work: Path) -> float:
        nodes = (ssh_node("node-a", server), ssh_node("node-b", server))
        job = TorchrunJob(nodes=nodes, worker=WORKER, nproc_per_node=1, rendezvous_timeout_s=60, timeout_s=300)
        start = time.perf_counter()
        outcome = asyncio.run(launch_torchrun(job, work / "out"))
        assert outcome.result["sum"] == 3.0
        return time.perf_counter() - start

    return run


def ours_slurm(setup: tuple[str, ...]) -> Callable[[Path], float]:
    def run(work: Path) -> float:
        settings = SlurmSettings(nodes=1, nproc_per_node=2, job_dir=str(work / "jobs"), poll_s=0.3)
        job = SlurmJob(LaunchNode("login-here", setup=setup), WORKER, settings, timeout_s=300)
        start = time.perf_counter()
        outcome = asyncio.run(launch_slurm(job, work / "out"))
        assert outcome.result["sum"] == 3.0
        return time.perf_counter() - start

    return run


def _request(work: Path) -> Path:
    path = work / "request.json"
    path.write_text(json.dumps(request_document(new_launch_id(), str(work / "result.json"), {})))
    return path


def measure(cases: dict[str, Callable[[Path], float]], reps: int, tmp: Path) -> dict[str, float]:
    """Interleaved: each rep runs every case once; medians."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(reps):
        for name, case in cases.items():
            work = tmp / f"{name}-{rep}"
            work.mkdir()
            times[name].append(case(work))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    reps = parser.parse_args().reps
    with tempfile.TemporaryDirectory(prefix="bench-launchers-") as name:
        tmp = Path(name)
        cases: dict[str, Callable[[Path], float]] = {"bare_1": bare_one_node, "ours_1": ours_one_node}
        server = cluster = None
        if SSHD is not None:
            keys = Keys.make(tmp / "keys")
            (tmp / "sshd").mkdir()
            server = OpenSshServer(tmp / "sshd", keys)
            known = write_known_hosts(tmp / "known_hosts", server.port, keys.host_pub)
            cases["bare_2"] = bare_two_agents
            cases["ssh_2"] = ours_two_nodes_ssh(LoopbackServer("openssh", server.port, getpass.getuser(), keys, known))
        else:
            print("two nodes over SSH: skipped (no sshd; scripts/sshd-install.sh)")
        try:
            start_s = None
            try:
                cluster = start_cluster(tmp / "slurm")
                start_s = cluster.started_s
                cases["slurm"] = ours_slurm(cluster.setup)
            except SlurmUnavailable as exc:
                print(f"Slurm: skipped ({exc})")
            (tmp / "warm").mkdir()
            bare_one_node(tmp / "warm")  # warm-up: the page cache holds torch afterwards
            got = measure(cases, reps, tmp)
        finally:
            if cluster is not None:
                left = cluster.stop()
                assert not left, left
            if server is not None:
                server.stop()
    print(f"medians of {reps}, interleaved (2 gloo processes, a 1-element all-reduce):")
    print(f"one node:  bare torchrun --standalone {got['bare_1']:.2f} s, launch_torchrun here {got['ours_1']:.2f} s "
          f"({got['ours_1'] - got['bare_1']:+.2f} s, {got['ours_1'] / got['bare_1']:.2f}x)")  # fmt: skip
    if "ssh_2" in got:
        bare, ours = got["bare_2"], got["ssh_2"]
        print(f"two nodes: bare two agents on 127.0.0.1 {bare:.2f} s, launch_torchrun over SSH {ours:.2f} s "
              f"({ours - bare:+.2f} s, {ours / bare:.2f}x)")  # fmt: skip
    if "slurm" in got:
        bare, ours = got["bare_1"], got["slurm"]
        print(f"Slurm:     cluster start {start_s:.2f} s; launch_slurm {ours:.2f} s vs bare torchrun {bare:.2f} s "
              f"({ours - bare:+.2f} s, {ours / bare:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
