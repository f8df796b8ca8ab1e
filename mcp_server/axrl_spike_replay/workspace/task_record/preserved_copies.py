"""Which preserved snapshot copies an investigation uses, and releasing exactly those at the end.

The task state keeps `preserved_copies`: each preserved copy (`spike_snapshots-active/iter_<N>`) of
a snapshot the task was pointed at, with the copy's marker time, noted when the snapshot was set or
a replay of it was logged. `report --release` releases only the copies noted for the task's
*current* snapshot — never those of snapshots it moved away from (another job's, say), never a copy
made again since it was noted, never one another open task in the workspace still points at, and
never the last copy of a snapshot (its rotating `iter_<N>` gone) unless `release_last_copy` is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, SNAPSHOTS_DIR, WORKSPACE_PRESERVED, parse_iteration
from axrl_spike_replay.workspace.task_record.evidence import output_dir_of
from axrl_spike_replay.workspace.task_record.task import TaskState

LAST_COPY_FLAG = "--release-last-copy"


def copy_of(snapshot: str | Path | None) -> dict[str, Any] | None:
    """{output_dir, iteration, path} of the preserved copy of `snapshot` (whether it exists or not), else None.
    The copy has the snapshot's own dir name (`iter_<N>`, or `iter_<N>-<tag>` for a tagged one)."""
    output_dir = output_dir_of(snapshot)
    name = Path(str(snapshot)).name if snapshot else ""
    iteration = parse_iteration(name) if snapshot else None
    if output_dir is None or iteration is None:
        return None
    path = Path(output_dir) / PRESERVED_DIR / name
    return {"output_dir": output_dir, "iteration": iteration, "path": str(path)}


def source_of(entry: dict[str, Any]) -> Path:
    """The rotating snapshot a noted copy preserved: the same dir name under `checkpoints/spike_snapshots`."""
    return Path(entry["output_dir"]) / SNAPSHOTS_DIR / Path(entry["path"]).name


def source_of_copy(snapshot: str | Path | None) -> Path | None:
    """The rotating `spike_snapshots/iter_<N>[-<tag>]` a preserved copy (`spike_snapshots-active/...`) was made from,
    whether it exists or not; None when `snapshot` is no preserved copy."""
    if not snapshot or Path(str(snapshot)).parent.name != PRESERVED_DIR.name:
        return None
    copy = copy_of(snapshot)
    return None if copy is None else source_of(copy)


def _marker_time(path: str) -> str | None:
    """The copy's marker `created_at` when it is a valid preserved copy made by this tool, else None."""
    from axrl_spike_replay.snapshot.preservation.preserved_marker import preserved_copy_problem, read_marker

    if preserved_copy_problem(path) is not None:
        return None
    marker, _ = read_marker(path)
    return str((marker or {}).get("created_at", ""))


def note_preserved_copy(state: TaskState, snapshot: str | Path | None, time: str) -> None:
    """Record in `state` the preserved copy of `snapshot` when one made by this tool exists now."""
    copy = copy_of(snapshot)
    if copy is None:
        return
    created = _marker_time(copy["path"])
    if created is None:
        return
    noted = state.preserved_copies
    if any(e.get("path") == copy["path"] and e.get("created_at") == created for e in noted):
        return
    noted.append({**copy, "snapshot": str(snapshot), "created_at": created, "time": time})


def copies_in_use(state: TaskState) -> list[dict[str, Any]]:
    """The noted copies of the task's current snapshot that still exist as the same copy (plain entries)."""
    current = copy_of(state.snapshot)
    if current is None:
        return []
    out: dict[str, dict[str, Any]] = {}
    for entry in state.preserved_copies:
        if not isinstance(entry, dict) or entry.get("path") != current["path"]:
            continue
        if _marker_time(current["path"]) == entry.get("created_at"):
            out[current["path"]] = dict(current)
    return list(out.values())


def workspace_copy_of(snapshot: str | Path | None, workspace: str | Path | None) -> dict[str, Any] | None:
    """{output_dir, iteration, path} of the copy `preserve` makes of `snapshot` in `workspace`
    (`preserved-snapshots/<output dir name>/<snapshot's dir name>`), or of `snapshot` itself when it is such a copy
    (its output dir then unknown: None); None when neither can be named."""
    if not snapshot:
        return None
    path = Path(str(snapshot))
    iteration = parse_iteration(path.name)
    if iteration is None:
        return None
    if path.parent.parent.name == WORKSPACE_PRESERVED.name:
        return {"output_dir": None, "iteration": iteration, "path": str(path)}
    output_dir = output_dir_of(snapshot)
    if output_dir is None or workspace is None:
        return None
    where = Path(workspace) / WORKSPACE_PRESERVED / Path(output_dir).name / path.name
    return {"output_dir": output_dir, "iteration": iteration, "path": str(where)}


def copies_kept(
    state: TaskState, in_use: list[dict[str, Any]], workspace: str | Path | None = None
) -> list[dict[str, Any]]:
    """Every other preserved copy of the task's snapshots that exists now, under the output root or in `workspace`
    (`preserve` into the workspace): never released by this task; why."""
    used = {e["path"] for e in in_use}
    current = copy_of(state.snapshot)
    seen: dict[str, dict[str, Any]] = {}
    snapshots = [e.get("snapshot") for e in state.snapshot_history]
    snapshots += [row.snapshot for row in state.experiments] + [state.snapshot]
    for snapshot in snapshots:
        for copy, in_workspace in ((copy_of(snapshot), False), (workspace_copy_of(snapshot, workspace), True)):
            if copy is None or copy["path"] in used or copy["path"] in seen or not Path(copy["path"]).is_dir():
                continue
            if in_workspace:
                reason = f"a copy in the workspace's {WORKSPACE_PRESERVED} (release it with `release --workspace`)"
            elif current is not None and copy["path"] == current["path"]:
                reason = "not noted as this investigation's copy (set the task snapshot again to adopt it)"
            else:
                reason = "not the task's current snapshot"
            seen[copy["path"]] = {**copy, "reason": reason}
    return list(seen.values())


def is_last_copy(entry: dict[str, Any]) -> bool:
    """True when the rotating snapshot this copy preserved is gone: the copy is the last one."""
    source = source_of(entry)
    return source.is_symlink() or not source.is_dir()


def release_copies(
    copies: list[dict[str, Any]], release_last_copy: bool = False, used_by: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Release each copy through the snapshot library (which removes only copies it made); one entry per copy.
    `used_by` {copy path: job}: copies another open task still points at, which are kept."""
    from axrl_spike_replay.snapshot.preservation.preserve import release

    out = []
    for entry in copies:
        other = (used_by or {}).get(entry["path"])
        if other is not None:
            out.append({**entry, "released": False, "error": f"task {other!r} still uses it; kept"})
            continue
        if is_last_copy(entry) and not release_last_copy:
            source = source_of(entry)
            error = (
                f"it is the last copy of iteration {entry['iteration']} ({source} has rotated away); kept — "
                f"pass {LAST_COPY_FLAG} to delete it anyway"
            )
            out.append({**entry, "released": False, "error": error})
            continue
        try:
            outcome = to_jsonable(release(Path(entry["output_dir"]), name=source_of(entry).name))
        except AxrlError as exc:
            out.append({**entry, "released": False, "error": str(exc)})
            continue
        released = any(Path(item.get("path", "")).name == source_of(entry).name for item in outcome.get("released", []))
        out.append({**entry, "released": released, "error": None if released else str(outcome.get("refused"))})
    return out
