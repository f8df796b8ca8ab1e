"""A copy is never readable by anyone who could not read its source: a 0640 log of one group, copied into a setgid
workspace of another group (as shared project dirs are set up), loses its group bits. Real files, a real setgid
directory and a real second group of this machine."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import pytest

from axrl_spike_replay.diagnosis.evidence.log_scan import scan_logs
from axrl_spike_replay.files.atomic import atomic_copy, copy_mode, current_umask

LOG = "".join(f" iteration {i}/ 40 | grad norm: {1.0 + (i == 30) * 50:.1f} | loss: 1.0 |\n" for i in range(1, 41))


def _other_group() -> int:
    """A group of this machine the test process is not running as (the workspace's group)."""
    for name in ("nogroup", "daemon", "users"):
        try:
            gid = grp.getgrnam(name).gr_gid
        except KeyError:
            continue
        if gid != os.getegid():
            return gid
    pytest.skip("no second group on this machine (nogroup, daemon, users)")


@pytest.fixture
def setgid_workspace(tmp_path: Path) -> Path:
    """A workspace dir 2775 owned by another group: files made in it take that group."""
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another group needs root (chown); run as root to check it")
    workspace = tmp_path / "shared-ws"
    workspace.mkdir()
    os.chown(workspace, -1, _other_group())
    workspace.chmod(0o2775)
    return workspace


def _group_private_log(tmp_path: Path) -> Path:
    """A log only its owner and its own group may read (0640, the test process's group)."""
    log = tmp_path / "run~job__actor" / "train.log"
    log.parent.mkdir()
    log.write_text(LOG)
    log.chmod(0o640)
    return log


def _mode_and_group(path: Path) -> tuple[int, int]:
    info = path.stat()
    return stat.S_IMODE(info.st_mode), info.st_gid


def test_a_copied_file_gets_no_group_bits_from_a_group_that_could_not_read_it(
    tmp_path: Path, setgid_workspace: Path
) -> None:
    log = _group_private_log(tmp_path)
    copy = atomic_copy(log, setgid_workspace / "train.log")
    mode, group = _mode_and_group(copy)
    assert group == setgid_workspace.stat().st_gid != log.stat().st_gid  # the setgid dir gave its group
    assert mode == 0o600 & ~current_umask(), oct(mode)  # before: 0640, readable by the workspace's group


def test_a_scanned_log_copied_into_a_setgid_workspace_gets_no_group_bits(
    tmp_path: Path, setgid_workspace: Path
) -> None:
    log = _group_private_log(tmp_path)
    scan = scan_logs([str(log)], dest=setgid_workspace / "logs")
    [copy] = [Path(p) for p in scan.copied]
    mode, group = _mode_and_group(copy)
    assert group == setgid_workspace.stat().st_gid
    assert mode == 0o600 & ~current_umask(), oct(mode)


def test_a_copy_in_the_sources_own_group_keeps_its_bits(tmp_path: Path) -> None:
    log = _group_private_log(tmp_path)
    mode, group = _mode_and_group(atomic_copy(log, tmp_path / "copy.log"))
    assert group == log.stat().st_gid and mode == 0o640 & ~current_umask()


@pytest.mark.parametrize(
    ("source", "same_group", "copy"),
    [
        (0o640, True, 0o640),
        (0o640, False, 0o600),  # the copy's group may hold users who read the source as others: none
        (0o644, False, 0o644),  # they read it as others anyway
        (0o604, True, 0o600),  # the copy's others may be in the source's group, which may not read it
        (0o4755, False, 0o755),  # set-id bits never carried
        (0o660, False, 0o600),
    ],
    ids=lambda v: oct(v) if isinstance(v, int) and not isinstance(v, bool) else ("same group" if v else "other group"),
)
def test_copy_mode_gives_each_class_what_every_reader_of_it_has_on_the_source(
    source: int, same_group: bool, copy: int
) -> None:
    assert copy_mode(source, same_group=same_group) == copy & ~current_umask()
