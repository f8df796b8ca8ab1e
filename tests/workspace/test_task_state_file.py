"""The task's state is one typed record, read and written in one place: a task file written by an earlier version
(fewer keys, a key this version does not know) opens, changes and is written back with nothing lost; a state file
whose fields have the wrong shape is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.workspace.paths import TASKS_DIR
from axrl_spike_replay.workspace.task_record.task import TaskState
from axrl_spike_replay.workspace.task_record.task_state import note, read_state, set_command, show_task

JOB = "older-job"
# What a task file looked like before preserved copies and diagnoses were kept, plus a key of a later version.
OLDER = {
    "format_version": 1,
    "job": JOB,
    "created_at": "2026-01-02T03:04:05+00:00",
    "updated_at": "2026-01-02T03:04:06+00:00",
    "snapshot": "/data/run1~older-job__actor/checkpoints/spike_snapshots/iter_0000012",
    "snapshot_history": [{"time": "2026-01-02T03:04:05+00:00", "snapshot": "/data/x/iter_0000012"}],
    "command": "axrl-spike-replay replay /data/x/iter_0000012",
    "experiments": [],
    "failed": [],
    "observations": [{"time": "2026-01-02T03:04:05+00:00", "text": "kept as written"}],
    "next_steps": [],
    "methods": [],
    "reports": [],
    "command_source": "user",
    "written_by_a_later_version": {"kept": True},
}


def _write(workspace: Path, doc: object) -> Path:
    path = workspace / TASKS_DIR / f"{JOB}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def test_an_older_task_file_opens_changes_and_keeps_everything_it_held(tmp_path: Path) -> None:
    path = _write(tmp_path, OLDER)
    state = read_state(tmp_path, JOB)
    assert isinstance(state, TaskState)
    assert state.snapshot_history == OLDER["snapshot_history"] and state.command_source == "user"
    assert state.preserved_copies == [] and state.diagnoses == []  # keys it did not have take their defaults

    note(tmp_path, JOB, "observations", "a new note")
    written = json.loads(path.read_text(encoding="utf-8"))
    assert written["written_by_a_later_version"] == {"kept": True}
    assert {k: v for k, v in written.items() if k in OLDER and k not in ("updated_at", "observations")} == {
        k: v for k, v in OLDER.items() if k not in ("updated_at", "observations")
    }
    assert [o["text"] for o in written["observations"]] == ["kept as written", "a new note"]
    assert written["preserved_copies"] == [] and written["diagnoses"] == []
    assert "a new note" in (tmp_path / TASKS_DIR / f"{JOB}.md").read_text(encoding="utf-8")
    assert show_task(tmp_path, JOB).snapshot == OLDER["snapshot"]


def test_a_new_task_writes_command_source_only_once_it_is_set(tmp_path: Path) -> None:
    _write(tmp_path, {k: v for k, v in OLDER.items() if k not in ("command_source", "written_by_a_later_version")})
    note(tmp_path, JOB, "next-steps", "try a sweep")
    assert "command_source" not in json.loads((tmp_path / TASKS_DIR / f"{JOB}.json").read_text())
    set_command(tmp_path, JOB, "my command")
    assert json.loads((tmp_path / TASKS_DIR / f"{JOB}.json").read_text())["command_source"] == "user"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"experiments": {"E1": {}}}, "`experiments` must be a list of records, got dict"),
        ({"observations": ["a bare string"]}, "`observations` must be a list of records, got list"),
        ({"snapshot": 12}, "`snapshot` must be text, got int"),
        ({"job": None}, "`job` is missing or not text"),
        ({"format_version": 2}, "is not a version-1 task state"),
    ],
)
def test_a_state_file_of_the_wrong_shape_is_refused_by_name(tmp_path: Path, change: dict, message: str) -> None:
    path = _write(tmp_path, {**OLDER, **change})
    with pytest.raises(AxrlError, match=message) as info:
        read_state(tmp_path, JOB)
    assert str(path) in str(info.value)
