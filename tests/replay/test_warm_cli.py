"""CLI replays with --warm run on a warm replay service: the cold replay's exact numbers and files, the same rank
processes for the second call, a socket only this user can use, a dead service's socket replaced, and nothing left
running once it stops."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.warm_client import service_pid
from axrl_spike_replay.investigation.warm_socket import warm_paths
from result_files import result_files, stable

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "mcp_server"


def _cli(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "axrl_spike_replay", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if f"\nPPid:\t{parent}\n" in status:
            found.append(int(entry.name))
    return found


def _descendants(root: int) -> list[int]:
    """The processes below `root`: the process server it started and the warm rank processes forked there."""
    found, todo = [], [root]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split()[1]


def _wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + 60
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow  # a service with two warm rank processes, and a cold replay to compare with
def test_two_warm_cli_replays_match_a_cold_one_on_the_same_processes(spike_snapshot: Path, tmp_path: Path) -> None:
    cold_ws, warm_ws = tmp_path / "cold", tmp_path / "warm"
    cold_ws.mkdir()
    warm_ws.mkdir()
    cold = _cli("replay", spike_snapshot, "--workspace", cold_ws, "--json", cwd=tmp_path)
    assert cold.returncode == 0, cold.stderr

    service = subprocess.Popen(
        [sys.executable, "-m", "axrl_spike_replay", "serve", "--workspace", warm_ws, "--warm-idle-timeout", "300"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT), "OMP_NUM_THREADS": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        paths = warm_paths(warm_ws)
        deadline = time.monotonic() + 120
        while service_pid(paths) != service.pid and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service_pid(paths) == service.pid
        assert stat.S_IMODE(os.stat(paths.dir).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(paths.socket).st_mode) == 0o600 and stat.S_ISSOCK(os.lstat(paths.socket).st_mode)

        warm, ranks = [], []
        for _ in range(2):
            done = _cli("replay", spike_snapshot, "--workspace", warm_ws, "--warm", "--json", cwd=tmp_path)
            assert done.returncode == 0, done.stderr
            warm.append(done)
            ranks.append(sorted(pid for pid in _descendants(service.pid) if _alive(pid)))
        assert "starting 2 warm replay process(es)" in warm[0].stderr
        assert "starting" not in warm[1].stderr and "weights ready" in warm[1].stderr  # progress streamed back
        assert len(ranks[0]) >= 2 and ranks[0] == ranks[1]  # the second call ran on the same rank processes

        expected = json.loads(cold.stdout)
        for done in warm:
            doc = json.loads(done.stdout)
            assert stable(doc) == stable(expected)  # bit-identical grad norms, top params, rank metrics, verdict
            assert result_files(doc["output_dir"]) == result_files(expected["output_dir"])
            assert Path(doc["output_dir"]).parent.parent.parent.parent == warm_ws  # written in the caller's workspace

        wrong = _cli("replay", spike_snapshot, "--workspace", warm_ws, "--warm", "--nproc", "0", cwd=tmp_path)
        assert wrong.returncode == 2 and "--nproc" in wrong.stderr  # refused as a cold call refuses it

        stopped = _cli("serve", "--workspace", warm_ws, "--stop", cwd=tmp_path)
        assert stopped.returncode == 0, stopped.stderr
        service.wait(timeout=60)
        assert not os.path.lexists(paths.socket)
        assert _wait_gone([service.pid, *ranks[0]]) == []  # no rank process outlives the service
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()


@pytest.mark.slow  # starts a service process and three CLI processes
def test_a_socket_left_by_a_dead_service_is_replaced(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    paths = warm_paths(ws)
    paths.dir.mkdir(parents=True, mode=0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    dead.bind(str(paths.socket))
    os.umask(old)
    dead.close()  # the file stays; nothing listens on it any more
    assert service_pid(paths) is None

    service = subprocess.Popen(
        [sys.executable, "-m", "axrl_spike_replay", "serve", "--workspace", ws, "--warm-idle-timeout", "60"],
        env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while service_pid(paths) != service.pid and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service_pid(paths) == service.pid
        second = _cli("serve", "--workspace", ws, cwd=tmp_path)  # one service per workspace
        assert second.returncode == 2 and f"pid {service.pid}" in second.stderr
        assert _cli("serve", "--workspace", ws, "--stop", cwd=tmp_path).returncode == 0
        service.wait(timeout=60)
        assert not os.path.lexists(paths.socket) and _wait_gone([service.pid]) == []
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()


def test_a_symlink_or_a_socket_others_can_use_is_refused(tmp_path: Path) -> None:
    from axrl_spike_replay.investigation.warm_socket import socket_paths

    ws = tmp_path / "ws"
    ws.mkdir()
    paths = warm_paths(ws)
    paths.dir.mkdir(parents=True, mode=0o700)
    elsewhere = tmp_path / "elsewhere.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(elsewhere))
    listener.listen(1)
    try:
        paths.socket.symlink_to(elsewhere)
        with pytest.raises(AxrlError, match="symlink"):
            service_pid(paths)
        os.chmod(elsewhere, 0o666)
        with pytest.raises(AxrlError, match="other users"):
            service_pid(socket_paths(elsewhere))
        refused = _cli("replay", tmp_path / "no-snapshot", "--server", elsewhere, cwd=tmp_path)
        assert refused.returncode == 2 and "other users" in refused.stderr
    finally:
        listener.close()


def test_a_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    from axrl_spike_replay.files.private_files import private_dir

    if os.getuid() != 0:
        pytest.skip("needs root to make a dir owned by another user")
    other = tmp_path / "theirs"
    other.mkdir(mode=0o700)
    os.chown(other, 65534, 65534)
    with pytest.raises(AxrlError, match="another user"):
        private_dir(other, create=False)
