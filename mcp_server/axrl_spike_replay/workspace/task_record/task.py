"""An investigation's task as data: `TaskState`, and its JSON document (`<job>.json`), read and written here only.

The task's own fields are typed, and so are its experiment rows (`workspace.task_record.experiment_row.ExperimentRow`);
the other rows (failed attempts, notes, preserved copies, diagnoses, methods, reports) are records of the task file and
stay plain JSON objects. A document written by an earlier version reads: a missing key takes its default, and a key
this version does not know is kept and written back as it was. `workspace.task_record.task_state` does the file work
(lock, atomic writes, the rendered markdown).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow

STATE_VERSION = 1
Row = dict[str, Any]


@dataclass(kw_only=True)
class TaskState:
    """One investigation's task: its active snapshot, replay command and every record the task file shows."""

    format_version: int = STATE_VERSION
    job: str
    created_at: str
    updated_at: str
    snapshot: str | None = None
    snapshot_history: list[Row] = field(default_factory=list)  # {time, snapshot}: every snapshot it was set to
    command: str | None = None
    experiments: list[ExperimentRow] = field(default_factory=list)  # one row per replayed config (task_log)
    failed: list[Row] = field(default_factory=list)
    observations: list[Row] = field(default_factory=list)  # {time, text}
    next_steps: list[Row] = field(default_factory=list)  # {time, text}
    methods: list[Row] = field(default_factory=list)  # {slug, attempt, status, time}: method files written
    reports: list[Row] = field(default_factory=list)
    preserved_copies: list[Row] = field(default_factory=list)  # the copies it uses
                                                               # (workspace.task_record.preserved_copies)
    diagnoses: list[Row] = field(default_factory=list)  # one per snapshot diagnosed (diagnosis.task_entry)
    command_source: str | None = None  # "user": set by hand, replays keep it; "replay": the last baseline replay run
    unknown: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as written

    @classmethod
    def new(cls, job: str, time: str) -> TaskState:
        """An empty task: no snapshot, no command, no experiments."""
        return cls(job=job, created_at=time, updated_at=time)

    @classmethod
    def from_json(cls, doc: Any, where: str, job: str, time: str) -> TaskState:
        """The task a `<job>.json` document holds (a missing `job` is `job`, missing times are `time`); AxrlError
        naming `where` and the field when it is not one."""
        if not isinstance(doc, Mapping) or doc.get("format_version") != STATE_VERSION:
            raise AxrlError(f"task state {where} is not a version-{STATE_VERSION} task state")
        known = {f.name: f for f in fields(cls) if f.name != "unknown"}
        values: dict[str, Any] = {"job": job, "created_at": time, "updated_at": time}
        for key, value in doc.items():
            if key not in known:
                continue
            if key in _LISTS and not (isinstance(value, list) and all(isinstance(row, dict) for row in value)):
                raise AxrlError(f"task state {where}: `{key}` must be a list of records, got {type(value).__name__}")
            if key in _TEXTS and value is not None and not isinstance(value, str):
                raise AxrlError(f"task state {where}: `{key}` must be text, got {type(value).__name__}")
            values[key] = value
        for key in ("job", "created_at", "updated_at"):
            if not isinstance(values.get(key), str):
                raise AxrlError(f"task state {where}: `{key}` is missing or not text")
        values["experiments"] = [
            ExperimentRow.from_json(row, f"task state {where}: experiments[{i}]")
            for i, row in enumerate(values.get("experiments", []))
        ]
        unknown = {key: value for key, value in doc.items() if key not in known}
        return cls(**values, unknown=unknown)

    def to_json(self) -> dict[str, Any]:
        """The `<job>.json` document: every field in declaration order (`command_source` only once set), then the
        unknown keys as read."""
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("command_source", "unknown")}
        doc["experiments"] = [row.to_json() for row in self.experiments]
        if self.command_source is not None:
            doc["command_source"] = self.command_source
        return {**doc, **self.unknown}


_LISTS = ("snapshot_history", "experiments", "failed", "observations", "next_steps", "methods", "reports")
_LISTS += ("preserved_copies", "diagnoses")
_TEXTS = ("snapshot", "command", "command_source")
