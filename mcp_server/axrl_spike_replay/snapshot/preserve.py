"""Preserve snapshots before rotation deletes them (hardlinks, never data copies on one filesystem), and
release the preserved copies again.

`preserve` builds each copy in a hidden staging dir (`.iter_<N>.preserving`) under
`checkpoints/spike_snapshots-active/`, checks it is complete, writes the marker
(`.axrl_preserved.json`) and only then renames it to `iter_<N>`: a half-preserved snapshot never
looks complete. A file is hardlinked; where the filesystem cannot link it (another filesystem,
EXDEV; or links not allowed) it is copied. The source is only read.

`release` deletes preserved copies only, and only those this tool made (marker present, naming
this tool and this iteration, and no file in the dir that the marker does not list).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from axrl_spike_replay import __version__
from axrl_spike_replay.atomic import atomic_write_json
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.locks import held_lock
from axrl_spike_replay.snapshot.completeness import missing_required
from axrl_spike_replay.snapshot.layout import PRESERVE_MARKER, PRESERVED_DIR, SNAPSHOTS_DIR, iteration_dir_name
from axrl_spike_replay.snapshot.listing import iteration_dirs

MADE_BY = "axrl-spike-replay"
_LOCK_NAME = ".axrl_preserve.lock"
# errnos where a hardlink is impossible but a copy works: other filesystem, links not supported/allowed
_NO_LINK_ERRNOS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


@dataclass
class PreservedCopy:
    """A preserved snapshot. `status`: "preserved" (made now) or "already_preserved" (nothing done)."""

    iteration: int
    path: str
    linked_files: int
    copied_files: int
    status: str = "preserved"
    source: str = ""


@dataclass
class PreserveFailure:
    """A snapshot that could not be preserved; nothing for it was left under `iter_<N>`."""

    iteration: int
    source: str
    error: str


@dataclass
class PreserveResult:
    output_dir: str
    preserved: list[PreservedCopy] = field(default_factory=list)
    failed: list[PreserveFailure] = field(default_factory=list)


@dataclass
class ReleasedCopy:
    iteration: int
    path: str


@dataclass
class RefusedRelease:
    path: str
    reason: str


@dataclass
class ReleaseResult:
    output_dir: str
    released: list[ReleasedCopy] = field(default_factory=list)
    refused: list[RefusedRelease] = field(default_factory=list)


class _SourceVanished(Exception):
    pass


def _output_dir(output_dir: str | Path) -> Path:
    directory = Path(os.path.abspath(output_dir))
    if not directory.is_dir():
        raise AxrlError(f"{directory}: output directory not found")
    return directory


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hardlink `src` to `dst` (True) or, where no link is possible, copy it (False)."""
    try:
        os.link(src, dst)
        return True
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_LINK_ERRNOS:
            raise
    shutil.copy2(src, dst)
    return False


def _source_files(source: Path) -> list[Path]:
    def fail(exc: OSError) -> None:
        raise _SourceVanished(f"{exc.filename}: {exc.strerror}")

    files = []
    for dirpath, _, names in os.walk(source, onerror=fail):
        files += [Path(dirpath, name).relative_to(source) for name in names]
    return sorted(files)


def _build_copy(source: Path, staging: Path, iteration: int) -> tuple[int, int]:
    """Link/copy every file of `source` into `staging`, check completeness, write the marker."""
    if not source.is_dir():
        raise _SourceVanished(f"{source}: no longer exists")
    files = _source_files(source)
    staging.mkdir()
    linked = copied = 0
    for rel in files:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            if _link_or_copy(source / rel, staging / rel):
                linked += 1
            else:
                copied += 1
        except FileNotFoundError:
            raise _SourceVanished(f"{source / rel} disappeared while preserving") from None
    intact = source.is_dir() and all((source / rel).exists() for rel in files)
    if not intact:
        # Rotation began while we linked: the listing may predate or postdate the start of the
        # deletion, so keep the copy only if it holds everything a snapshot needs.
        missing = missing_required(staging)
        if missing:
            detail = missing[0].replace(str(staging), str(source))
            raise _SourceVanished(f"the copy is incomplete: {detail}")
    marker = {
        "made_by": MADE_BY,
        "version": __version__,
        "iteration": iteration,
        "source": str(source.resolve()),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": [str(rel) for rel in files],
        "linked_files": linked,
        "copied_files": copied,
    }
    atomic_write_json(staging / PRESERVE_MARKER, marker)
    return linked, copied


def _preserve_one(source: Path, preserved_root: Path, iteration: int) -> PreservedCopy | PreserveFailure:
    final = preserved_root / iteration_dir_name(iteration)
    if final.exists():
        reason = preserved_copy_problem(final)
        if reason is None:
            marker = _read_marker(final) or {}
            return PreservedCopy(iteration, str(final), 0, 0, "already_preserved", str(marker.get("source", "")))
        return PreserveFailure(iteration, str(source), f"{final} exists but {reason}; left untouched")
    staging = preserved_root / f".{final.name}.preserving"
    if staging.exists():
        shutil.rmtree(staging)  # left by an interrupted preserve of ours (we hold the lock)
    try:
        linked, copied = _build_copy(source, staging, iteration)
        os.rename(staging, final)
    except _SourceVanished as exc:
        shutil.rmtree(staging, ignore_errors=True)
        return PreserveFailure(
            iteration, str(source), f"source was rotated away or is incomplete ({exc}); nothing was preserved"
        )
    except OSError as exc:  # permissions, a full disk, ...: reported, nothing left behind
        shutil.rmtree(staging, ignore_errors=True)
        where = exc.filename or staging
        return PreserveFailure(iteration, str(source), f"{where}: {exc.strerror or exc}; nothing was preserved")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return PreservedCopy(iteration, str(final), linked, copied, "preserved", str(source))


def preserve(
    output_dir: str | Path, iteration: int | None = None, progress: Callable[[str], None] | None = None
) -> PreserveResult:
    """Preserve retained snapshot `iteration`, or every retained snapshot when None (cheap: hardlinks).

    `progress` receives a line per snapshot done (for long copies across filesystems).
    Idempotent: an existing preserved copy is reported as "already_preserved". A source rotated away
    (or found incomplete) mid-copy becomes a `failed` entry and leaves nothing under `iter_<N>`.
    A requested iteration that is not retained raises AxrlError.
    """
    directory = _output_dir(output_dir)
    retained = iteration_dirs(directory / SNAPSHOTS_DIR)
    if iteration is not None:
        if iteration not in retained:
            have = ", ".join(str(i) for i in retained) or "none"
            raise AxrlError(
                f"{directory / SNAPSHOTS_DIR / iteration_dir_name(iteration)}: no retained snapshot for "
                f"iteration {iteration} (retained: {have})"
            )
        retained = {iteration: retained[iteration]}
    preserved_root = directory / PRESERVED_DIR
    try:
        preserved_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AxrlError(f"{preserved_root}: cannot create the preserved dir ({exc.strerror or exc})") from None
    result = PreserveResult(output_dir=str(directory))
    with held_lock(preserved_root / _LOCK_NAME, 300, f"preserved snapshots in {preserved_root}"):
        for it, source in retained.items():
            outcome = _preserve_one(source, preserved_root, it)
            (result.preserved if isinstance(outcome, PreservedCopy) else result.failed).append(outcome)
            if progress is not None:
                status = outcome.status if isinstance(outcome, PreservedCopy) else "failed"
                progress(f"iteration {it}: {status} ({len(result.preserved) + len(result.failed)}/{len(retained)})")
    return result


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((path / PRESERVE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def preserved_copy_problem(path: str | Path) -> str | None:
    """Why `path` is not a complete preserved copy made by this tool, or None when it is one."""
    directory = Path(path)
    if directory.is_symlink() or not directory.is_dir():
        return "is not a directory (or is a symlink)"
    if directory.parent.name != PRESERVED_DIR.name:
        return f"is not inside {PRESERVED_DIR}"
    marker = _read_marker(directory)
    if marker is None:
        return f"has no readable {PRESERVE_MARKER} marker (not made by {MADE_BY})"
    if marker.get("made_by") != MADE_BY:
        return f"its marker names {marker.get('made_by')!r}, not {MADE_BY}"
    if directory.name != iteration_dir_name(int(marker.get("iteration", -1))):
        return f"its marker is for iteration {marker.get('iteration')}, not {directory.name}"
    listed = set(marker.get("files") or [])
    present = {str(Path(d, n).relative_to(directory)) for d, _, names in os.walk(directory) for n in names}
    present.discard(PRESERVE_MARKER)
    extra = sorted(present - listed)
    if extra:
        return f"it holds files the marker does not list ({', '.join(extra[:3])})"
    return None


def _release_one(path: Path, snapshots_root: Path) -> str | None:
    reason = preserved_copy_problem(path)
    if reason is None and snapshots_root.exists() and path.resolve().is_relative_to(snapshots_root.resolve()):
        reason = f"it resolves into the rotating {SNAPSHOTS_DIR}"
    if reason is not None:
        return reason
    doomed = path.parent / f".{path.name}.releasing"
    try:
        os.rename(path, doomed)  # a half-deleted copy never looks like a preserved snapshot
        shutil.rmtree(doomed)
    except OSError as exc:
        raise AxrlError(f"{exc.filename or path}: cannot delete ({exc.strerror or exc})") from None
    return None


def release(output_dir: str | Path, iteration: int | None = None) -> ReleaseResult:
    """Delete preserved copy `iteration`, or every preserved copy when None; never anything else.

    A copy that is not provably ours is refused: raises AxrlError for a requested iteration, or is
    listed in `refused` when releasing all. Retained snapshots are never touched.
    """
    directory = _output_dir(output_dir)
    preserved_root = directory / PRESERVED_DIR
    found = iteration_dirs(preserved_root)
    if iteration is not None:
        if iteration not in found:
            have = ", ".join(str(i) for i in found) or "none"
            raise AxrlError(
                f"{preserved_root / iteration_dir_name(iteration)}: no preserved copy for iteration "
                f"{iteration} (preserved: {have})"
            )
        found = {iteration: found[iteration]}
    result = ReleaseResult(output_dir=str(directory))
    if not found:
        return result
    with held_lock(preserved_root / _LOCK_NAME, 300, f"preserved snapshots in {preserved_root}"):
        for it, path in found.items():
            try:
                reason = _release_one(path, directory / SNAPSHOTS_DIR)
            except AxrlError as exc:
                if iteration is not None:
                    raise
                result.refused.append(RefusedRelease(str(path), str(exc)))
                continue
            if reason is None:
                result.released.append(ReleasedCopy(it, str(path)))
            elif iteration is not None:
                raise AxrlError(f"{path}: refused to delete: {reason}")
            else:
                result.refused.append(RefusedRelease(str(path), reason))
    return result
