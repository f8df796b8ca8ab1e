"""A workspace whose path is too long for a socket has its warm service in this user's runtime dir, which no other
user can take first: once it went to `/tmp/axrl-spike-replay-<hash>`, a name anyone could create before `serve`,
blocking it and `replay --warm`. Dirs of another user are made here as root (skipped elsewhere)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from axrl_spike_replay.files.private_files import private_dir
from axrl_spike_replay.investigation.warm_socket import warm_paths

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "mcp_server"
NOBODY = 65534


@pytest.fixture
def temp_base(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A system temp dir of this test's own (short, as /tmp is), without XDG_RUNTIME_DIR (`tmp_path` first: pytest
    finds its own temp dir through tempfile too)."""
    base = Path(tempfile.mkdtemp(prefix="axrl-rt-", dir="/tmp"))
    base.chmod(0o1777)  # as /tmp: anyone may create names in it
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def long_workspace(tmp_path: Path) -> Path:
    workspace = tmp_path / ("w" * 120)
    workspace.mkdir()
    return workspace


def _needs_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to make a dir owned by another user")


def _serve_stop(workspace: Path, base: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    environ |= {"PYTHONPATH": str(PACKAGE_ROOT), "TMPDIR": str(base), **env}
    argv = [sys.executable, "-m", "axrl_spike_replay", "serve", "--workspace", str(workspace), "--stop"]
    return subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=120)


def test_a_dir_another_user_made_at_the_old_predictable_name_does_not_block_the_service(
    temp_base: Path, long_workspace: Path
) -> None:
    _needs_root()
    digest = hashlib.sha256(os.fsencode(long_workspace.resolve())).hexdigest()[:16]
    squat = temp_base / f"axrl-spike-replay-{digest}"
    squat.mkdir(mode=0o777)
    os.chown(squat, NOBODY, NOBODY)
    paths = warm_paths(long_workspace)
    mine = temp_base / f"axrl-spike-replay-{os.getuid()}"
    assert paths.dir.parent == mine and paths.dir != squat
    private_dir(paths.dir, create=True)  # what `serve` and `--warm` do first: once "belongs to another user"
    for made in (mine, paths.dir):
        st = os.lstat(made)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert len(os.fsencode(paths.socket)) <= 100


@pytest.mark.parametrize("taken", ["dir", "symlink"])
def test_a_runtime_dir_another_user_holds_is_refused_by_name(temp_base: Path, long_workspace: Path, taken: str) -> None:
    _needs_root()
    mine = temp_base / f"axrl-spike-replay-{os.getuid()}"
    if taken == "dir":
        mine.mkdir(mode=0o777)
        os.chown(mine, NOBODY, NOBODY)
    else:
        theirs = temp_base / "theirs"
        theirs.mkdir(mode=0o777)
        os.chown(theirs, NOBODY, NOBODY)
        mine.symlink_to(theirs)
    done = _serve_stop(long_workspace, temp_base)
    assert done.returncode == 2, done.stderr
    said = done.stderr
    assert str(mine) in said and ("another user" in said or "symlink" in said) and "XDG_RUNTIME_DIR" in said
    assert "Traceback" not in said
    assert not any((temp_base / "theirs").glob("*")) if taken == "symlink" else not any(mine.iterdir())


def test_xdg_runtime_dir_is_used_when_it_is_this_users_alone(
    temp_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from axrl_spike_replay.investigation.warm_socket import runtime_dir

    runtime = temp_base / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert runtime_dir() == runtime
    runtime.chmod(0o777)  # others may make names in it: not a runtime dir of this user alone
    assert runtime_dir() == temp_base / f"axrl-spike-replay-{os.getuid()}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/run")
    assert runtime_dir() == temp_base / f"axrl-spike-replay-{os.getuid()}"
    if os.getuid() == 0:
        runtime.chmod(0o700)
        os.chown(runtime, NOBODY, NOBODY)  # another user's (as after `su` without a login)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        assert runtime_dir() == temp_base / f"axrl-spike-replay-{os.getuid()}"


def test_a_runtime_dir_of_this_user_with_wider_permissions_is_made_private(temp_base: Path) -> None:
    from axrl_spike_replay.investigation.warm_socket import runtime_dir

    mine = temp_base / f"axrl-spike-replay-{os.getuid()}"
    mine.mkdir(mode=0o755)
    mine.chmod(0o755)
    assert runtime_dir() == mine and stat.S_IMODE(os.lstat(mine).st_mode) == 0o700
