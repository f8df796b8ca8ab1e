"""The marker of a preserved copy (`.axrl_preserved.json`): who made it, for which iteration, which files.

`release` deletes a copy only when its marker says this tool made it for that iteration and lists every
file in it. The marker sits on shared storage, so it is read as untrusted input: bounded, not through a
symlink or a FIFO, validated field by field; a bad one refuses its own copy by name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.snapshot.layout import (
    PRESERVE_MARKER,
    PRESERVED_DIR,
    WORKSPACE_PRESERVED,
    iteration_dir_name,
    parse_iteration,
)
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, read_bounded
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json

MADE_BY = "axrl-spike-replay"
# A marker lists file names: a few KiB even for thousands of checkpoint shards; anything larger is not ours.
MARKER_MAX_BYTES = 8 * 1024 * 1024
MARKER_MAX_DEPTH = 8  # a marker nests two levels (an object holding a list of names)


def read_marker(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(marker, None) for a preserved copy's valid marker; (None, why it is not usable) otherwise.

    A valid marker is a JSON object with `made_by` (a string), `iteration` (an integer >= 0) and
    `files` (a list of relative file names); `source`, `created_at` and `name` (the copy's dir name, written since
    snapshot names may carry a tag: `iter_<N>-<tag>`), when present, are strings.
    """
    marker_path = Path(path) / PRESERVE_MARKER
    try:
        data = read_bounded(marker_path, MARKER_MAX_BYTES, follow_symlinks=False)
        doc = parse_untrusted_json(data, MARKER_MAX_DEPTH)
    except FileNotFoundError:
        return None, f"has no readable {PRESERVE_MARKER} marker"
    except UntrustedInputError as exc:
        return None, f"its {PRESERVE_MARKER} marker {exc}"
    except OSError as exc:
        return None, f"its {PRESERVE_MARKER} marker cannot be read ({exc.strerror or exc})"
    problem = _marker_problem(doc)
    return (None, f"its {PRESERVE_MARKER} marker {problem}") if problem else (doc, None)


def _marker_problem(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return f"is not a JSON object (a {type(doc).__name__})"
    if not isinstance(doc.get("made_by"), str):
        return f"has no made_by name (made_by: {shown(doc.get('made_by'), 60)})"
    iteration = doc.get("iteration")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        return f"has iteration {shown(iteration, 60)}, not a whole number >= 0"
    files = doc.get("files")
    if not isinstance(files, list) or not all(_plain_relative(name) for name in files):
        bad = files if not isinstance(files, list) else next(n for n in files if not _plain_relative(n))
        return f"has a file list that is not relative file names ({shown(bad, 60)})"
    for key in ("source", "created_at", "name"):
        if key in doc and not isinstance(doc[key], str):
            return f"has {key} {shown(doc[key], 60)}, not a string"
    return None


def _plain_relative(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and not os.path.isabs(name) and ".." not in Path(name).parts


def preserved_copy_problem(path: str | Path) -> str | None:
    """Why `path` is not a complete preserved copy made by this tool, or None when it is one."""
    directory = Path(path)
    if directory.is_symlink() or not directory.is_dir():
        return "is not a directory (or is a symlink)"
    in_workspace = directory.parent.parent.name == WORKSPACE_PRESERVED.name  # <workspace>/<this>/<output dir>/
    if directory.parent.name != PRESERVED_DIR.name and not in_workspace:
        return f"is not inside {PRESERVED_DIR} (or a workspace's {WORKSPACE_PRESERVED}/<output dir>)"
    marker, problem = read_marker(directory)
    if marker is None:
        return f"{problem} (not made by {MADE_BY})"
    if marker["made_by"] != MADE_BY:
        return f"its marker names {shown(marker['made_by'], 60)}, not {MADE_BY}"
    named = marker.get("name")  # markers from before tagged names carry none: the plain `iter_<N>` then
    expected = named if named is not None else iteration_dir_name(marker["iteration"])
    if directory.name != expected or parse_iteration(expected) != marker["iteration"]:
        made_for = "" if named is None else f" (a copy named {shown(named, 80)})"
        return f"its marker is for iteration {marker['iteration']}, not {directory.name}{made_for}"
    listed = set(marker["files"])
    present = {str(Path(d, n).relative_to(directory)) for d, _, names in os.walk(directory) for n in names}
    present.discard(PRESERVE_MARKER)
    extra = sorted(present - listed)
    if extra:
        return f"it holds files the marker does not list ({shown(', '.join(extra[:3]), 200, quote=False)})"
    return None
