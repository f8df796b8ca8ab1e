"""A replay killed mid-run (SIGTERM or SIGKILL) leaves no process running and no temp dir behind: not its rank
processes, not the process server they were forked from (nor anything else it started).

On a GPU node a leftover rank would hold its GPU until the end of a long replay.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import axrl_spike_replay

PACKAGE_ROOT = Path(axrl_spike_replay.__file__).resolve().parents[1]
GENEROUS_S = 60.0


def _children(pid: int) -> set[int]:
    """Pids of the live processes whose parent is `pid`."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return {child for child in pids if _alive(child) and (_parent_and_state(child) or (0, ""))[0] == pid}


def _descendants(root: int) -> set[int]:
    """Pids of the live processes below `root`: its children, theirs, and so on."""
    found, todo = set(), [root]
    while todo:
        for child in _children(todo.pop()):
            found.add(child)
            todo.append(child)
    return found


def _parent_and_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), fields[0]


def _alive(pid: int) -> bool:
    info = _parent_and_state(pid)
    return info is not None and info[1] != "Z"


def _eventually(check, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + GENEROUS_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture
def temp_root() -> Iterator[Path]:
    """The replay's TMPDIR, a dir of this test's own in /tmp: short, as the process server's socket path under it
    must be (a pytest-xdist worker's tmp_path is longer than a single process's)."""
    path = Path(tempfile.mkdtemp(prefix="axrl-killed-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start_long_replay(
    snapshot: Path, tmp_path: Path, temp_root: Path, method: str = "forkserver"
) -> subprocess.Popen[bytes]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    env = {**os.environ, "TMPDIR": str(temp_root), "PYTHONPATH": str(PACKAGE_ROOT), "AXRL_START_METHOD": method}
    argv = [sys.executable, "-m", "axrl_spike_replay", "replay", str(snapshot), "--workspace", str(workspace)]
    # the most repeats allowed: seconds of replaying, far longer than the kill below takes to land
    cli = subprocess.Popen([*argv, "--repeat", "100"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # the ranks have met (their FileStore exists) and are replaying
    _eventually(lambda: any(temp_root.glob("axrl-ranks-*/store")), "the replay never started its rank processes")
    return cli


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "method"),
    [(signal.SIGKILL, "forkserver"), (signal.SIGTERM, "forkserver"), (signal.SIGKILL, "spawn")],
    ids=["SIGKILL", "SIGTERM", "SIGKILL-spawned"],
)
def test_a_killed_replay_leaves_no_rank_process_and_no_temp_dir(
    spike_snapshot: Path, tmp_path: Path, temp_root: Path, sig: signal.Signals, method: str
) -> None:
    cli = _start_long_replay(spike_snapshot, tmp_path, temp_root, method)
    spawned = _descendants(cli.pid)
    if method == "forkserver":  # forked by the process server, a child of the CLI
        ranks = spawned - _children(cli.pid)
    else:  # spawned by the CLI itself
        ranks = {pid for pid in spawned if b"multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    assert len(ranks) >= 2, "expected the two rank processes of the saved world size"

    cli.send_signal(sig)
    cli.wait(timeout=GENEROUS_S)
    stderr = cli.stderr.read().decode() if cli.stderr else ""

    _eventually(lambda: not any(_alive(pid) for pid in spawned), f"processes outlived the replay: {spawned}")
    _eventually(lambda: not list(temp_root.glob("axrl-*")), f"temp dirs left: {list(temp_root.iterdir())}")
    if sig == signal.SIGTERM:
        assert cli.returncode == 130
        assert "replay: interrupted" in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_a_killed_replay_of_a_legacy_snapshot_leaves_no_linked_copy(
    legacy_snapshot: Path, tmp_path: Path, temp_root: Path
) -> None:
    cli = _start_long_replay(legacy_snapshot, tmp_path, temp_root)
    assert list(temp_root.glob(f"axrl-replay-{legacy_snapshot.name}-*")), "the legacy replay dir was not made"
    spawned = _descendants(cli.pid)

    cli.kill()
    cli.wait(timeout=GENEROUS_S)

    _eventually(lambda: not any(_alive(pid) for pid in spawned), f"processes outlived the replay: {spawned}")
    _eventually(lambda: not list(temp_root.glob("axrl-*")), f"temp dirs left: {list(temp_root.iterdir())}")
