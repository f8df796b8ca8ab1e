"""Opening an investigation's task: the record's task file, with a diagnosis of a snapshot it has not diagnosed yet.

Orchestration, not record: it asks the record whether the snapshot is diagnosed, runs `diagnose` outside the
task's lock (it may take seconds; `diagnosis.task_entry` says what each mode costs), then hands the entry to the
workspace to write (`workspace.task_record.task_state.open_task_file`). Both faces' `task open` call `open_task`.

A later diagnosis run (`diagnose`, MCP `diagnose_spike`) goes through `diagnose_into_task`: the same diagnosis,
kept in the task of the snapshot's job when one is open, so the record holds the strongest diagnosis made, not
only the cheap one of `task open`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from axrl_spike_replay.diagnosis.diagnose import Diagnosis, diagnose_snapshot
from axrl_spike_replay.diagnosis.task_entry import check_mode, diagnose_for_task, diagnosis_entry
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.request.request_parts import How
from axrl_spike_replay.workspace.paths import check_workspace, task_md_path
from axrl_spike_replay.workspace.task_record.task_log import record_diagnosis
from axrl_spike_replay.workspace.task_record.task_state import diagnosed, open_task_file, recorded_snapshot
from axrl_spike_replay.workspace.task_record.views import TaskView


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


def diagnose_into_task(
    workspace: str | Path | None,
    snapshot: str | Path,
    *,
    attribution: Any = None,
    logs: Sequence[str | Path] | None = None,
    model: str = "auto",
    top: int = 10,
    how: How | None = None,
) -> Diagnosis:
    """`diagnose_snapshot`, and the result kept in the task of the snapshot's job when `workspace` has one open
    (nothing is written otherwise; a task that cannot be written to leaves the diagnosis as it is)."""
    from axrl_spike_replay.snapshot.metadata import read_metadata

    result = diagnose_snapshot(snapshot, attribution=attribution, logs=logs, model=model, top=top, how=how)
    if workspace is None:
        return result
    try:
        job = read_metadata(result.snapshot)[0].job_name
        root = check_workspace(workspace)
        if job:
            entry = {**diagnosis_entry(result, model), "snapshot": recorded_snapshot(snapshot)}
            kept = record_diagnosis(root, job, entry)
            result.record = (
                f"kept in the task file {task_md_path(root, job)} (workspace {root})"
                if kept
                else f"not kept: no task is open for job {job} in workspace {root} "
                f"(`axrl-spike-replay task open {job} --workspace {root}` opens one)"
            )
    except AxrlError as exc:
        result.record = f"not kept: {exc}"  # the diagnosis stands without its record
    return result
