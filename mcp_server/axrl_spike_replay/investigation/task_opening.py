"""Opening an investigation's task: the record's task file, with a diagnosis of a snapshot it has not diagnosed yet.

Orchestration, not record: it asks the record whether the snapshot is diagnosed, runs `diagnose` outside the
task's lock (it may take seconds; `diagnosis.task_entry` says what each mode costs), then hands the entry to the
workspace to write (`workspace.task_state.open_task_file`). Both faces' `task open` call `open_task`.
"""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.diagnosis.task_entry import check_mode, diagnose_for_task
from axrl_spike_replay.workspace.task_state import diagnosed, open_task_file, recorded_snapshot
from axrl_spike_replay.workspace.views import TaskView


def open_task(
    workspace: str | Path, job: str, snapshot: str | Path | None = None, *, diagnosis: str = "never"
) -> TaskView:
    """Open (or re-open, keeping its history) the task for `job`; optionally set its active snapshot.

    A snapshot the task has not diagnosed yet is diagnosed (`diagnose` with model evidence `diagnosis`: never,
    the default, reads the static evidence only, without loading the weights; auto and always add attribution
    and route agreement; off skips it) and the result written into Observations and Next steps."""
    check_mode(diagnosis)
    entry = None
    if snapshot is not None and diagnosis != "off":
        target = recorded_snapshot(snapshot)
        if not diagnosed(workspace, job, target):
            entry = {**diagnose_for_task(target, diagnosis), "snapshot": target}
    return open_task_file(workspace, job, snapshot, diagnosis=entry)
