"""Method files after `report --release`: the preserved copy a method was replayed from is gone, so the file names
the rotating snapshot it was copied from (which stays until the job's rotation removes it), as the task and the
report do, and says that the copy was released and when.

Only the fields and lines the method template wrote from the copy's path change (`snapshot:` in the front matter,
the snapshot row of "Job and snapshot", the note under "Replay it"); the evidence, the rationale and every other
line stay as written. The front matter keeps the released path as `released_copy` (and `released_at`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from axrl_spike_replay.files.locks import held_lock
from axrl_spike_replay.workspace.method_files import front_matter
from axrl_spike_replay.workspace.method_files.methods import RELEASED_LATER, method_files
from axrl_spike_replay.workspace.paths import TASKS_DIR
from axrl_spike_replay.workspace.render import md_cell
from axrl_spike_replay.workspace.task_record.preserved_copies import source_of
from axrl_spike_replay.workspace.task_record.task_state import write_file


def follow_released_copies(workspace: Path, released: list[dict[str, Any]], time: str) -> list[str]:
    """Point the workspace's method files replayed from a copy `released` removed at the rotating snapshot it was
    made from, when that still exists; the paths of the files rewritten."""
    moved = {
        str(entry["path"]): str(source_of(entry))
        for entry in released
        if entry.get("released") and source_of(entry).is_dir()
    }
    if not moved:
        return []
    done = []
    with held_lock(workspace / TASKS_DIR / ".methods.lock", 120, "method files"):
        for method in method_files(workspace):
            old = method.get("snapshot")
            if not isinstance(old, str) or old not in moved:
                continue
            path = Path(method["path"])
            text = path.read_text(encoding="utf-8")
            body = text[
                text.index(f"\n{front_matter.FENCE}\n", len(front_matter.FENCE)) + len(front_matter.FENCE) + 2 :
            ]
            fields = {k: v for k, v in method.items() if k != "path"}
            fields |= {"snapshot": moved[old], "released_copy": old, "released_at": time}
            write_file(path, front_matter.dump(fields) + _body_after(body, old, moved[old], time), "method file")
            done.append(str(path))
    return done


def _body_after(body: str, old: str, new: str, time: str) -> str:
    """The method file's markdown with the released copy's lines rewritten (see the module's note)."""
    row = f"| snapshot | {md_cell(old)} |"
    after = (
        f"| snapshot | {md_cell(new)} |\n| replayed from | {md_cell(old)}, a preserved copy released {md_cell(time)} |"
    )
    return body.replace(row, after, 1).replace(RELEASED_LATER, f"which was released {time} (`report --release`)", 1)
