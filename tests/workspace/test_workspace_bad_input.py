"""Bad input gets a clear error that names what is wrong, and nothing already written is lost."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from record_helpers import JOB, replay_result, save_result

from axrl_spike_replay.cli import main
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.files import atomic
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.report import write_report
from axrl_spike_replay.workspace.task_record.task_log import record_failure, record_replay
from axrl_spike_replay.workspace.task_record.task_state import note, show_task

SNAP = Path("/snapshots/run~fixture-moe__actor/checkpoints/spike_snapshots/iter_0000005")


@pytest.fixture()
def task(tmp_path: Path) -> Path:
    """A workspace with a task holding a baseline (E1), a cleared attempt (E2) and a failure (F1)."""
    open_task(tmp_path, JOB, snapshot=SNAP)
    for name, result in (
        ("base", replay_result(SNAP, 37.4, "reproduced")),
        ("tis", replay_result(SNAP, 3.8, "cleared", mitigations={"mismatch_token_clip_max": 2})),
    ):
        record_replay(tmp_path, JOB, result, save_result(tmp_path, name, result))
    record_failure(tmp_path, JOB, reason="node unreachable", command="replay --target gpu1", snapshot=str(SNAP))
    return tmp_path


def test_unknown_job_names_the_job_and_the_open_tasks(task: Path, capsys) -> None:
    with pytest.raises(AxrlError, match=r"unknown job 'other-job'.*open tasks: fixture-moe.*task open other-job"):
        show_task(task, "other-job")
    assert main(["report", "other-job", "--workspace", str(task)]) == 2
    assert "unknown job 'other-job'" in capsys.readouterr().err


def test_unknown_or_failed_attempt_is_refused(task: Path) -> None:
    with pytest.raises(AxrlError, match=r"unknown attempt id 'E9' .*experiments: E1, E2"):
        add_method(task, JOB, "E9", "m", "r")
    with pytest.raises(AxrlError, match=r"attempt F1 .* failed \(node unreachable\)"):
        add_method(task, JOB, "F1", "m", "r")
    with pytest.raises(AxrlError, match=r"verdict 'reproduced'"):
        add_method(task, JOB, "E1", "baseline", "r")
    assert not (task / "spike-mitigation-methods").exists()


def test_existing_method_name_is_refused_unless_replacing(task: Path) -> None:
    first = add_method(task, JOB, "E2", "tis", "first reason")
    # The snapshot is gone: the method is still written from the recorded figures, and says the snapshot is gone.
    text = Path(first.path).read_text()
    assert f"snapshot {SNAP} is no longer there; the figures here are those recorded while it was" in text
    assert "- spike: recorded grad norm 37.42" in text
    other = replay_result(SNAP, 2.0, "cleared", mitigations={"advantage_clip": 1})
    record_replay(task, JOB, other, save_result(task, "adv", other))
    with pytest.raises(AxrlError, match=r"tis.md already exists for a different change"):
        add_method(task, JOB, "E3", "tis", "other")
    with pytest.raises(AxrlError, match="duplicate method"):
        add_method(task, JOB, "E2", "tis-again", "same change, new name")
    again = add_method(task, JOB, "E2", "tis", "regenerated reason", replace=True)
    assert again.path == first.path and "regenerated reason" in Path(again.path).read_text()
    assert [m["slug"] for m in show_task(task, JOB).methods] == ["tis"]


def test_missing_workspace(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(AxrlError, match=r"workspace .*nope.* does not exist"):
        open_task(missing, JOB)
    assert main(["task", "open", JOB, "--workspace", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    assert not missing.exists()
    # A replay with no task open (or no workspace) is simply not logged.
    assert record_replay(missing, JOB, replay_result(SNAP, 1.0, "reproduced"), "r.json") is None
    assert record_replay(tmp_path, JOB, replay_result(SNAP, 1.0, "reproduced"), "r.json") is None


@pytest.mark.parametrize("slug", ["../x", "a/b", "", "  ", ".hidden", "a\\b", "README", "x y"])
def test_method_slug_must_be_a_plain_file_name(task: Path, slug: str) -> None:
    with pytest.raises(ConfigError, match="method name"):
        add_method(task, JOB, "E2", slug, "why")
    assert not (task / "x.md").exists() and not (task / "spike-mitigation-methods").exists()


@pytest.mark.parametrize("job", ["../x", "a/b", ".task"])
def test_job_name_must_be_a_plain_file_name(tmp_path: Path, job: str, capsys) -> None:
    assert main(["task", "open", job, "--workspace", str(tmp_path)]) == 2
    assert "job name" in capsys.readouterr().err
    assert not (tmp_path / "agent-task").exists() or not any((tmp_path / "agent-task").rglob("*.json"))


def test_unknown_section_and_empty_note(task: Path) -> None:
    with pytest.raises(ConfigError, match="section 'ideas'"):
        note(task, JOB, "ideas", "x")
    with pytest.raises(ConfigError, match="empty"):
        note(task, JOB, "observations", "  ")


def test_corrupt_task_state_is_reported(task: Path) -> None:
    state = task / "agent-task" / "spike-replay" / f"{JOB}.json"
    state.write_text("{ half written")
    with pytest.raises(AxrlError, match=r"task state .*fixture-moe.json is unreadable"):
        show_task(task, JOB)


class _HalfWriter:
    """A file that takes half the bytes, then fails as a full disk does."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def write(self, data: bytes) -> int:
        self.handle.write(data[: len(data) // 2])
        self.handle.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


class _FullDiskOs:
    """`os` as the atomic writer sees it, with a disk that fills up mid-write (a real full disk cannot be
    made here without root, so only the file handle is replaced)."""

    def __getattr__(self, name: str):
        return getattr(os, name)

    @staticmethod
    def fdopen(fd: int, mode: str):
        return _HalfWriter(os.fdopen(fd, mode))


def test_disk_full_leaves_the_old_task_file_intact(task: Path, monkeypatch) -> None:
    folder = task / "agent-task" / "spike-replay"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(atomic, "os", _FullDiskOs())
    result = replay_result(SNAP, 20.0, "partial", mitigations={"advantage_clip": 3})
    with pytest.raises(AxrlError, match=r"could not write task state .*fixture-moe.json: No space left on device"):
        record_replay(task, JOB, result, save_result(task, "adv", result))
    with pytest.raises(AxrlError, match=r"could not write report"):
        write_report(task, JOB)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert after == before  # same files, same bytes, no temp file left behind
    assert [row.id for row in show_task(task, JOB).experiments] == ["E1", "E2"]
    assert not (task / "tmp" / "spike-replay" / JOB / "report.md").exists()
