"""An output root the user may not (or asked us not to) write into: `preserve` puts its copies in the workspace,
hardlinks where the filesystem allows and copies otherwise, with the bytes to copy held to the free space first.

Permissions are checked for real. Running as root, a dir without write bits does not stop writes (os.access says
writable, honestly): the unwritable root is then a read-only bind mount, which refuses root too; where mounting
is not allowed either, that part is skipped and the explicit option (`no_writes`) still covers the behaviour."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.snapshot.layout import PRESERVE_MARKER, PRESERVED_DIR, SNAPSHOTS_DIR, WORKSPACE_PRESERVED
from axrl_spike_replay.snapshot.preservation.preserve import preserve, release


def _tree(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def _mount(args: list[str]) -> bool:
    return os.geteuid() == 0 and subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """`directory` made unwritable for this user for real: write bits off for a normal user; as root (whom mode
    bits do not stop) a read-only bind mount over it. Skips where neither can be done."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")] if p.is_dir()}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    if not _mount(["--bind", str(directory), str(directory)]):
        pytest.skip("running as root, where mode bits do not stop writes, and no bind mount is allowed here")
    try:
        if not _mount(["-o", "remount,bind,ro", str(directory)]):
            pytest.skip("running as root, and this kernel refuses a read-only bind remount")
        assert not os.access(directory, os.W_OK), "a read-only mount must read as unwritable"
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_asked_for_no_writes_preserve_links_into_the_workspace_and_release_removes_it(
    make_output_dir, tmp_path: Path, cli
) -> None:
    out = make_output_dir()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    before = _tree(out)

    result = preserve(out, 42, workspace=workspace, no_writes=True)

    assert _tree(out) == before  # nothing written under the output root, not even the preserved dir
    assert result.in_workspace and "no writes" in result.reason
    [copy] = result.preserved
    target = workspace / WORKSPACE_PRESERVED / out.name / "iter_0000042"
    assert Path(copy.path) == target and Path(result.preserved_root) == target.parent
    source = out / SNAPSHOTS_DIR / "iter_0000042"
    files = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())
    assert copy.linked_files == len(files) and copy.copied_files == 0  # one filesystem: hardlinks, no bytes
    assert all((target / f).stat().st_ino == (source / f).stat().st_ino for f in files)
    assert json.loads((target / PRESERVE_MARKER).read_text())["source"] == str(source.resolve())
    assert inspect_snapshot(target).problems == []

    again = cli("preserve", out, "--iteration", "42", "--into-workspace", "--workspace", workspace, "--json")
    assert json.loads(again.out)["preserved"][0]["status"] == "already_preserved"
    released = release(out, 42, workspace=workspace)
    assert [Path(r.path) for r in released.released] == [target] and not target.exists()
    assert source.is_dir() and _tree(out) == before


def test_an_unwritable_output_root_preserves_into_the_workspace_and_says_why(make_output_dir, tmp_path: Path) -> None:
    out = make_output_dir()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with unwritable(out):
        with pytest.raises(AxrlError, match="not writable by this user; name a workspace"):
            preserve(out, 42)
        result = preserve(out, 42, workspace=workspace)
        assert not (out / PRESERVED_DIR).exists()
    assert result.in_workspace and result.reason == f"{out / PRESERVED_DIR} is not writable by this user"
    [copy] = result.preserved
    assert Path(copy.path) == workspace / WORKSPACE_PRESERVED / out.name / "iter_0000042"
    assert copy.linked_files + copy.copied_files > 0 and inspect_snapshot(copy.path).problems == []


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """An 8 KiB tmpfs (another filesystem, too small for a snapshot); skipped where mounting is not allowed."""
    where = tmp_path / "small"
    where.mkdir()
    if not _mount(["-t", "tmpfs", "-o", "size=8k", "tmpfs", str(where)]):
        pytest.skip("mounting a small tmpfs needs root and a kernel that allows it here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_workspace_without_room_for_the_copy_is_refused_before_a_byte_is_written(
    make_output_dir, small_filesystem: Path
) -> None:
    out = make_output_dir()
    source = out / SNAPSHOTS_DIR / "iter_0000042"
    needed = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    assert needed > 8 * 1024, "the snapshot must not fit the small filesystem for this test to mean anything"

    result = preserve(out, 42, workspace=small_filesystem, no_writes=True)

    [failure] = result.failed
    assert f"needs {needed} bytes but" in failure.error and "nothing was preserved" in failure.error
    root = small_filesystem / WORKSPACE_PRESERVED / out.name
    assert [p.name for p in root.iterdir() if p.name != ".axrl_preserve.lock"] == []  # no staging dir left
    assert result.preserved == []


def test_a_workspace_copy_is_listed_marked_and_finds_its_job_logs(make_output_dir, tmp_path: Path, cli) -> None:
    """After `preserve --into-workspace`, `snapshots` lists the copy (marked) and the steps that read the job's log
    by default (`inspect`, the replay's and the diagnosis's log point) find the output dir's log from the copy."""
    from axrl_spike_replay.snapshot.listing import list_snapshots
    from axrl_spike_replay.snapshot.log_point import job_logs, log_point

    out = make_output_dir()
    log = out / "logs" / "train.log"
    log.write_text("".join(f"step={i} grad_norm={1.0 + i / 100:.2f} loss=0.5\n" for i in range(30, 43)))
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    [copy] = preserve(out, 42, workspace=workspace, no_writes=True).preserved
    target = Path(copy.path)

    assert not any(e.in_workspace for e in list_snapshots(out).snapshots)  # no workspace named: not looked at
    listed = [e for e in list_snapshots(out, workspace=workspace).snapshots if e.in_workspace]
    assert [(Path(e.path), e.preserved, e.iteration) for e in listed] == [(target, True, 42)]
    shown = cli("snapshots", out, "--workspace", workspace)
    assert "preserved (workspace)" in shown.out and str(target) in shown.out

    assert job_logs(target) == [log]
    point = log_point(target, 42)
    assert point.grad_norm == pytest.approx(1.42) and point.source == str(log)
    consistency = inspect_snapshot(target).consistency
    assert consistency is not None and consistency.log_source == str(log) and consistency.log_grad_norm == 1.42

    other = make_output_dir("elsewhere")  # another output dir: its name differs, so its copies never show here
    shutil.copytree(target, workspace / WORKSPACE_PRESERVED / other.name / target.name)
    assert not any(e.in_workspace for e in list_snapshots(other, workspace=workspace).snapshots)
    assert any("another output dir" in s.reason for s in list_snapshots(other, workspace=workspace).skipped)
