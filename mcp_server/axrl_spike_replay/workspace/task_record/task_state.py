"""An investigation's task on disk: its state (`workspace.task_record.task.TaskState`) in `<job>.json`, rendered to
`<job>.md`, under a file lock; and the verbs that change it (open, note, set snapshot, set command, show)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.files.atomic import atomic_write_text
from axrl_spike_replay.files.locks import held_lock
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.workspace.paths import TASKS_DIR, check_workspace, task_json_path, task_md_path
from axrl_spike_replay.workspace.render import render
from axrl_spike_replay.workspace.task_record.preserved_copies import copy_of, note_preserved_copy
from axrl_spike_replay.workspace.task_record.task import TaskState
from axrl_spike_replay.workspace.task_record.task_diagnosis import add_diagnosis, has_diagnosis, open_steps
from axrl_spike_replay.workspace.task_record.views import TaskView

LOCK_TIMEOUT_S = 120.0
SECTIONS = {"observations": "observations", "next-steps": "next_steps", "next_steps": "next_steps"}

T = TypeVar("T")


def now() -> str:
    """Current UTC time, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_state(job: str) -> TaskState:
    """An empty task: no snapshot, no command, no experiments."""
    return TaskState.new(job, now())


@contextmanager
def task_lock(workspace: Path, job: str) -> Iterator[None]:
    """Hold `<job>.json.lock`: one writer at a time, across processes."""
    path = task_json_path(workspace, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    with held_lock(str(path) + ".lock", LOCK_TIMEOUT_S, f"task {job!r}"):
        yield


def task_exists(workspace: Path, job: str) -> bool:
    """True when a task for `job` is open in `workspace`."""
    return task_json_path(workspace, job).is_file()


def read_state(workspace: Path, job: str) -> TaskState:
    """The task's state; AxrlError naming the job and the open tasks when there is none."""
    path = task_json_path(workspace, job)
    if not path.is_file():
        known = sorted(p.stem for p in (workspace / TASKS_DIR).glob("*.json"))
        hint = f"open tasks: {', '.join(known)}" if known else "no task is open there"
        raise AxrlError(
            f"unknown job {job!r}: no task file {path} ({hint}); run `axrl-spike-replay task open {job}` first"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AxrlError(f"task state {path} is unreadable: {exc}") from exc
    return TaskState.from_json(doc, str(path), job, now())


def write_state(workspace: Path, job: str, state: TaskState) -> None:
    """Render the markdown first (so a template error writes nothing), then replace both files atomically."""
    state.updated_at = now()
    text = render_task(state, workspace)
    doc = json.dumps(state.to_json(), indent=2, default=str) + "\n"
    write_file(task_json_path(workspace, job), doc, "task state")
    write_file(task_md_path(workspace, job), text, "task file")


def write_file(path: Path, text: str, what: str) -> Path:
    """Replace `path` atomically; a failed write (disk full, read-only) is an AxrlError and leaves the old file."""
    try:
        return atomic_write_text(path, text)
    except OSError as exc:
        raise AxrlError(
            f"could not write {what} {path}: {exc.strerror or exc}; the previous file is unchanged"
        ) from exc


def render_task(state: TaskState, workspace: Path | None = None) -> str:
    """The task file's markdown from its state; table paths inside `workspace` are shown relative to it."""

    def rel(path: Any) -> Any:
        if workspace is None or not path:
            return path
        try:
            return str(Path(str(path)).relative_to(workspace))
        except ValueError:
            return path

    # commands people copy name the workspace: the default, the current directory, is wherever they run them
    flag = f" --workspace {shlex.quote(str(workspace))}" if workspace is not None else ""
    return render("task.md.j2", task={**state.to_json(), "next_steps": open_steps(state)}, rel=rel, ws=flag)


def update_task(
    workspace: str | Path, job: str, change: Callable[[TaskState], T], *, create: bool = False
) -> tuple[TaskState, T]:
    """Under the lock: read the state (or start one when `create`), apply `change`, write it back."""
    root = check_workspace(workspace)
    check_plain_name(job, "job name")
    with task_lock(root, job):
        state = read_state(root, job) if (task_exists(root, job) or not create) else new_state(job)
        value = change(state)
        write_state(root, job, state)
    return state, value


def open_task_file(
    workspace: str | Path, job: str, snapshot: str | Path | None = None, *, diagnosis: dict[str, Any] | None = None
) -> TaskView:
    """Open (or re-open, keeping its history) the task file for `job`; optionally set its active snapshot, and keep
    `diagnosis` (an entry of `diagnosis.task_entry`) in Observations and Next steps unless the task already holds
    one of that snapshot. Opening with a fresh diagnosis is `investigation.task_opening.open_task`."""

    def change(state: TaskState) -> None:
        if snapshot is not None:
            set_task_snapshot(state, snapshot)
        if diagnosis is not None and not has_diagnosis(state, diagnosis["snapshot"]):
            add_diagnosis(state, diagnosis, now())

    state, _ = update_task(workspace, job, change, create=True)
    return show(state, check_workspace(workspace))


def diagnosed(workspace: str | Path, job: str, snapshot: str) -> bool:
    """True when the task of `job` is open and already holds a diagnosis of `snapshot` (as `recorded_snapshot` gives
    it)."""
    root = check_workspace(workspace)
    return task_exists(root, check_plain_name(job, "job name")) and has_diagnosis(read_state(root, job), snapshot)


def used_by_other_tasks(workspace: Path, job: str) -> dict[str, str]:
    """{preserved copy path: job} for the copies of the current snapshots of the workspace's other open tasks."""
    out: dict[str, str] = {}
    for state_file in sorted((workspace / TASKS_DIR).glob("*.json")):
        if state_file.stem == job:
            continue
        try:
            other = read_state(workspace, state_file.stem)
        except AxrlError:
            continue
        current = copy_of(other.snapshot)
        if current is not None:
            out.setdefault(current["path"], state_file.stem)
    return out


def note(workspace: str | Path, job: str, section: str, text: str) -> TaskView:
    """Append `text` to Observations or Next steps."""
    key = SECTIONS.get(section)
    if key is None:
        raise ConfigError(f"section {section!r} is not one of: observations, next-steps")
    if not text or not text.strip():
        raise ConfigError(f"note for {section} is empty")

    def change(state: TaskState) -> None:
        rows = state.observations if key == "observations" else state.next_steps
        rows.append({"time": now(), "text": text.strip("\n")})

    state, _ = update_task(workspace, job, change)
    return show(state, check_workspace(workspace))


def set_snapshot(workspace: str | Path, job: str, snapshot: str | Path) -> TaskView:
    """Set the active snapshot (earlier ones stay in the history)."""
    state, _ = update_task(workspace, job, lambda s: set_task_snapshot(s, snapshot))
    return show(state, check_workspace(workspace))


def set_command(workspace: str | Path, job: str, command: str) -> TaskView:
    """Set the replay command people can rerun."""
    if not command or not command.strip():
        raise ConfigError("replay command is empty")

    def change(state: TaskState) -> None:
        state.command = command.strip()
        state.command_source = "user"  # replays no longer replace it with the command they ran

    state, _ = update_task(workspace, job, change)
    return show(state, check_workspace(workspace))


def show_task(workspace: str | Path, job: str) -> TaskView:
    """The task: sections, `experiments`, `failed`, file paths."""
    root = check_workspace(workspace)
    return show(read_state(root, check_plain_name(job, "job name")), root)


def show(state: TaskState, workspace: Path) -> TaskView:
    """State plus where its files are."""
    return TaskView(
        format_version=state.format_version,
        job=state.job,
        created_at=state.created_at,
        updated_at=state.updated_at,
        snapshot=state.snapshot,
        snapshot_history=state.snapshot_history,
        command=state.command,
        experiments=state.experiments,
        failed=state.failed,
        observations=state.observations,
        next_steps=open_steps(state),
        methods=state.methods,
        reports=state.reports,
        preserved_copies=state.preserved_copies,
        task_file=str(task_md_path(workspace, state.job)),
        state_file=str(task_json_path(workspace, state.job)),
    )


def recorded_snapshot(snapshot: str | Path) -> str:
    """The snapshot path as the task records it (resolved when it exists)."""
    text = str(snapshot).strip()
    if not text:
        raise ConfigError("snapshot path is empty")
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


def set_task_snapshot(state: TaskState, snapshot: str | Path) -> None:
    """Make `snapshot` the task's active snapshot in `state` (history kept; a preserved copy of it noted)."""
    resolved = recorded_snapshot(snapshot)
    note_preserved_copy(state, resolved, now())  # also when set again: adopts a copy made since
    if state.snapshot == resolved:
        return
    state.snapshot = resolved
    state.snapshot_history.append({"time": now(), "snapshot": resolved})
