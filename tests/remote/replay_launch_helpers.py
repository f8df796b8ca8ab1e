"""Helpers for the tests of replays launched by torchrun and Slurm: a workspace whose spike-replay.yaml names the
loopback nodes, the replay's worker processes in the process table, and waiting for them."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from ssh_loopback import SSHD, LoopbackServer, OpenSshServer, write_known_hosts

from axrl_spike_replay.remote.launchers.launch_job import LAUNCH_ID_ENV

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
SNAPSHOT = FIXTURE / "checkpoints" / "spike_snapshots" / "iter_0000021"  # tiny MoE, saved world size 2
WORKER_MODULE = "axrl_spike_replay.replay.jobs.torchrun_worker"
# `replay_workers` sees every replay worker on this machine, whichever test launched it: under pytest-xdist the tests
# that launch replays run on one worker, one at a time (with the Slurm tests: tests/conftest.py).
ONE_WORKER = pytest.mark.xdist_group("launches")


def copy_snapshot(tmp_path: Path) -> Path:
    """A private copy of the world-size-2 fixture snapshot (a test may hide or change it)."""
    dest = tmp_path / "shared" / "spike_snapshots" / SNAPSHOT.name
    shutil.copytree(SNAPSHOT, dest)
    return dest


def node_entry(server: LoopbackServer, python: str = sys.executable, setup: tuple[str, ...] = ()) -> dict[str, Any]:
    """A `targets:` entry for a node reached through `server`."""
    entry: dict[str, Any] = {"ssh": server.spec(), "python": python}
    if setup:
        entry["setup"] = list(setup)
    return entry


def write_workspace(root: Path, targets: dict[str, dict[str, Any]], **sections: Any) -> Path:
    """A workspace whose spike-replay.yaml holds `targets` and the other sections given (multinode, slurm)."""
    root.mkdir(parents=True, exist_ok=True)
    doc = {"targets": targets, **sections}
    (root / "spike-replay.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return root


def pair(rendezvous_timeout_s: float = 30.0, nodes: tuple[str, str] = ("node-a", "node-b")) -> dict[str, Any]:
    """A `multinode:` entry of two loopback nodes, one process each, meeting on 127.0.0.1."""
    return {
        "nodes": list(nodes),
        "nproc_per_node": 1,
        "addresses": {name: "127.0.0.1" for name in nodes},
        "rendezvous_timeout_s": rendezvous_timeout_s,
    }


def _environ(pid: str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def replay_workers() -> dict[str, list[str]]:
    """{launch id: pids} of the replay's worker processes running now (every loopback node's are here)."""
    found: dict[str, list[str]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if WORKER_MODULE.encode() not in cmdline or b"torch.distributed.run" in cmdline:
            continue
        tags = [item for item in _environ(pid) if item.startswith(f"{LAUNCH_ID_ENV}=".encode())]
        if tags:
            found.setdefault(tags[0].split(b"=", 1)[1].decode(), []).append(pid)
    return found


def wait_for_workers(count: int, done: Callable[[], bool], seconds: float = 120.0) -> str:
    """The launch id once `count` replay workers of one job run; fails if the run ended first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for launch_id, pids in replay_workers().items():
            if len(pids) >= count:
                return launch_id
        assert not done(), "the replay ended before its workers were seen running"
        time.sleep(0.1)
    raise AssertionError(f"no job with {count} replay workers within {seconds} s: {replay_workers()}")


def blind_node(
    tmp_path: Path, server: LoopbackServer, hide: Path, mounts: str = "true"
) -> tuple[OpenSshServer, LoopbackServer]:
    """An sshd in its own mount namespace (a node without shared storage): `hide` covered by an empty directory, then
    the `mounts` commands; the test is skipped where sshd or `unshare -m` cannot run. The caller stops the server."""
    if SSHD is None or shutil.which("unshare") is None:
        pytest.skip("needs OpenSSH sshd and unshare")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "blind").mkdir()
    script = f'mount --bind {empty} {hide} && {mounts} && exec "$@"'
    try:
        blind = OpenSshServer(tmp_path / "blind", server.keys, prefix=("unshare", "-m", "sh", "-c", script, "sh"))
    except RuntimeError as exc:
        pytest.skip(f"cannot start an sshd in its own mount namespace here: {exc}")
    known = write_known_hosts(tmp_path / "blind" / "kh", blind.port, server.keys.host_pub)
    return blind, LoopbackServer("openssh", blind.port, server.user, server.keys, known)
