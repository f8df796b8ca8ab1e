"""Helpers for the launcher tests: nodes on the loopback sshd, the test worker, and the process table."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from ssh_loopback import LoopbackServer

from axrl_spike_replay.remote.launchers.launch_job import LAUNCH_ID_ENV, LaunchNode, WorkerEntry
from axrl_spike_replay.remote.transport.target import parse_target
from axrl_spike_replay.remote.transport.target_config import ResolvedTarget

WORKER = WorkerEntry(script=str(Path(__file__).with_name("allreduce_worker.py")))


def ssh_node(name: str, server: LoopbackServer, *setup: str, python: str = sys.executable) -> LaunchNode:
    """A node reached through the loopback server (each node is its own SSH connection)."""
    target = ResolvedTarget(ssh=parse_target(server.spec()), python=python, setup=tuple(setup), name=name)
    return LaunchNode(name, target, address="127.0.0.1")


def tagged_processes(launch_id: str) -> list[str]:
    """Live processes carrying the job's tag in their environment (loopback: every node's processes are here)."""
    tag = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if tag in environ:
            found.append(f"{name} {cmdline.decode(errors='replace')[:200]}")
    return found


def wait_until_untagged(launch_id: str, seconds: float = 15.0) -> list[str]:
    """The job's processes still alive after up to `seconds` (empty: none left)."""
    deadline = time.monotonic() + seconds
    while (left := tagged_processes(launch_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


async def wait_for_files(directory: Path, count: int, task: asyncio.Future, seconds: float = 90.0) -> None:
    """Until `directory` holds `count` files (each worker's ready mark); fails early if the job already ended."""
    deadline = time.monotonic() + seconds
    while len(list(directory.iterdir())) < count:
        if task.done():
            task.result()  # raises the job's error
            raise AssertionError("the job ended before every worker was ready")
        assert time.monotonic() < deadline, f"only {sorted(p.name for p in directory.iterdir())} ready"
        await asyncio.sleep(0.05)
