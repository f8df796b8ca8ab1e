"""Preserve snapshots before rotation deletes them (hardlinks, never data copies on one filesystem), and
release the preserved copies again.

`preserve` builds each copy in a hidden staging dir (`.iter_<N>.preserving`) under
`checkpoints/spike_snapshots-active/`, checks it is complete, writes the marker
(`.axrl_preserved.json`) and only then renames it to `iter_<N>`: a half-preserved snapshot never
looks complete. A file is hardlinked; where the filesystem cannot link it (another filesystem,
EXDEV; or links not allowed) it is copied. The source is only read.

Where the output root is not writable, or no writes there are wanted, the copies go into the workspace instead
(`preserve_target`): hardlinks where the filesystem allows, copies otherwise, the bytes to copy held to the free
space first.

`release` deletes preserved copies only, and only those this tool made (see `preserved_marker`: marker
present, naming this tool and this iteration, and no file in the dir that the marker does not list);
a bad marker makes its copy refused by name and the other copies proceed.

Symlinks are never followed out of the tree: an `iter_<N>` that is a symlink leading out of its
snapshots dir is skipped and reported, and a file inside a snapshot that is a
symlink leading out of it is neither linked nor copied (reported in `skipped`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from axrl_spike_replay import __version__
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.files.atomic import atomic_copy, atomic_write_json
from axrl_spike_replay.files.locks import held_lock
from axrl_spike_replay.snapshot.completeness import missing_required
from axrl_spike_replay.snapshot.layout import (
    PRESERVE_MARKER,
    PRESERVED_DIR,
    SNAPSHOTS_DIR,
    WORKSPACE_PRESERVED,
    iteration_dir_name,
    parse_iteration,
    parse_snapshot_name,
)
from axrl_spike_replay.snapshot.listing import SkippedEntry, scan_iteration_dirs
from axrl_spike_replay.snapshot.preservation.preserve_target import (
    PreserveTarget,
    check_space,
    preserve_target,
    same_filesystem,
)
from axrl_spike_replay.snapshot.preservation.preserved_marker import MADE_BY, preserved_copy_problem, read_marker
from axrl_spike_replay.untrusted.containment import link_leaving

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
    """What `preserve` did. `skipped`: entries not followed (symlinks out of the tree), with the reason."""

    output_dir: str
    preserved: list[PreservedCopy] = field(default_factory=list)
    failed: list[PreserveFailure] = field(default_factory=list)
    skipped: list[SkippedEntry] = field(default_factory=list)
    preserved_root: str = ""  # where the copies are (empty: nothing to preserve)
    in_workspace: bool = False  # the copies are in the workspace, not under the output root
    reason: str = ""  # why in the workspace


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


class _Unsafe(Exception):
    """The snapshot needs a file we will not follow (a symlink out of it)."""


def _output_dir(output_dir: str | Path) -> Path:
    directory = Path(os.path.abspath(output_dir))
    if not directory.is_dir():
        raise AxrlError(f"{directory}: output directory not found")
    return directory


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hardlink `src` to `dst` (True) or, where no link is possible, copy it (False): with its times, and never more
    readable than `src` (its mode less the umask)."""
    try:
        os.link(src, dst)
        return True
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_LINK_ERRNOS:
            raise
    check_space(src.stat().st_size, dst.parent, f"copying {src}")
    atomic_copy(src, dst, keep_times=True)
    return False


def _source_files(source: Path, iteration: int) -> tuple[list[Path], list[SkippedEntry]]:
    """(regular files of `source` to preserve, entries skipped and why): no symlink is followed out of it."""

    def fail(exc: OSError) -> None:
        raise _SourceVanished(f"{exc.filename}: {exc.strerror}")

    files, skipped = [], []
    for dirpath, dirnames, names in os.walk(source, onerror=fail):
        for name in dirnames:  # os.walk never descends into a symlinked dir: say so
            if Path(dirpath, name).is_symlink():
                skipped.append(_skip(Path(dirpath, name), source, iteration, "is a symlinked directory"))
        for name in names:
            path = Path(dirpath, name)
            reason = _file_problem(path, source)
            if reason is None:
                files.append(path.relative_to(source))
            else:
                skipped.append(SkippedEntry(str(path), reason, iteration))
    return sorted(files), skipped


def _skip(path: Path, source: Path, iteration: int, what: str) -> SkippedEntry:
    leaving = link_leaving(path, source)
    return SkippedEntry(str(path), f"{leaving or what}; not followed", iteration)


def _file_problem(path: Path, source: Path) -> str | None:
    """Why a file of the snapshot is not linked or copied (a symlink out of it, not a regular file), else None."""
    leaving = link_leaving(path, source)
    if leaving is not None:
        return f"{leaving}; not linked or copied"
    try:
        mode = path.stat().st_mode  # a symlink inside the snapshot: its target, also inside
    except FileNotFoundError:
        return None  # rotated away: found missing while linking
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc}); not linked or copied"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a pipe, socket or device); not linked or copied"
    return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0  # rotated away: found missing while linking


def _build_copy(source: Path, staging: Path, iteration: int, skipped: list[SkippedEntry]) -> tuple[int, int]:
    """Link/copy every regular file of `source` into `staging`, check completeness, write the marker."""
    if not source.is_dir():
        raise _SourceVanished(f"{source}: no longer exists")
    files, not_followed = _source_files(source, iteration)
    skipped += not_followed
    if not same_filesystem(source, staging.parent):  # every byte is copied: it must fit before one is written
        check_space(sum(_size(source / rel) for rel in files), staging.parent, f"a copy of {source}")
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
    if not intact or not_followed:
        # Rotation began while we linked (the listing may predate or postdate the start of the
        # deletion), or entries were skipped: keep the copy only if it holds everything a snapshot needs.
        missing = missing_required(staging)
        if missing:
            detail = missing[0].replace(str(staging), str(source))
            if intact:
                raise _Unsafe(f"the copy would be incomplete without the skipped entries: {detail}")
            raise _SourceVanished(f"the copy is incomplete: {detail}")
    marker = {
        "made_by": MADE_BY,
        "version": __version__,
        "iteration": iteration,
        "name": source.name,
        "source": str(source.resolve()),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": [str(rel) for rel in files],
        "linked_files": linked,
        "copied_files": copied,
    }
    atomic_write_json(staging / PRESERVE_MARKER, marker)
    return linked, copied


def _preserve_one(
    source: Path, preserved_root: Path, iteration: int, skipped: list[SkippedEntry]
) -> PreservedCopy | PreserveFailure:
    final = preserved_root / source.name  # the copy keeps the snapshot's name (`iter_<N>` or `iter_<N>-<tag>`)
    if final.exists() or final.is_symlink():
        reason = preserved_copy_problem(final)
        if reason is None:
            marker = read_marker(final)[0] or {}
            return PreservedCopy(iteration, str(final), 0, 0, "already_preserved", str(marker.get("source", "")))
        return PreserveFailure(iteration, str(source), f"{final} exists but {reason}; left untouched")
    staging = preserved_root / f".{final.name}.preserving"
    if staging.is_symlink() or staging.is_file():
        staging.unlink()  # not ours to follow: only the entry itself goes
    elif staging.exists():
        shutil.rmtree(staging)  # left by an interrupted preserve of ours (we hold the lock)
    try:
        linked, copied = _build_copy(source, staging, iteration, skipped)
        os.rename(staging, final)
    except _SourceVanished as exc:
        shutil.rmtree(staging, ignore_errors=True)
        return PreserveFailure(
            iteration, str(source), f"source was rotated away or is incomplete ({exc}); nothing was preserved"
        )
    except _Unsafe as exc:
        shutil.rmtree(staging, ignore_errors=True)
        return PreserveFailure(iteration, str(source), f"{exc}; nothing was preserved")
    except OSError as exc:  # permissions, a full disk, ...: reported, nothing left behind
        shutil.rmtree(staging, ignore_errors=True)
        where = exc.filename or staging
        return PreserveFailure(iteration, str(source), f"{where}: {exc.strerror or exc}; nothing was preserved")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return PreservedCopy(iteration, str(final), linked, copied, "preserved", str(source))


def preserve(
    output_dir: str | Path,
    iteration: int | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    name: str | None = None,
    workspace: str | Path | None = None,
    no_writes: bool = False,
) -> PreserveResult:
    """Preserve the retained snapshots of `iteration` (every run's: `iter_<N>` and `iter_<N>-<tag>`), or the one
    dir `name`, or every retained snapshot when both are None (cheap: hardlinks). A copy keeps its source's name.

    The copies go under the output root, or into `workspace` (`preserved-snapshots/<output dir name>/`) when
    `no_writes` asks for no writes under the output root or that root is not writable (`preserve_target`); the
    result says where and why. Bytes that must be copied are held to the target's free space first.

    `progress` receives a line per snapshot done (for long copies across filesystems).
    Idempotent: an existing preserved copy is reported as "already_preserved". A source rotated away
    (or found incomplete) mid-copy becomes a `failed` entry and leaves nothing under `iter_<N>`; so does
    an `iter_<N>` that is a symlink leading out of the snapshots dir (never followed). Files of a snapshot
    that are symlinks leading out of it are not linked or copied: they are listed in `skipped`.
    A requested iteration or name that is not retained (or is such a symlink) raises AxrlError.
    """
    directory = _output_dir(output_dir)
    retained, skipped = scan_iteration_dirs(directory / SNAPSHOTS_DIR)
    iteration = parse_iteration(name) if name is not None else iteration
    wanted = iteration is not None
    refused = [s for s in skipped if _selected(Path(s.path).name, iteration, name) or s.iteration is None]
    if refused and (wanted or refused[0].iteration is None):
        raise AxrlError(f"{refused[0].path} {refused[0].reason}; nothing was preserved")
    if wanted:
        retained = {n: path for n, path in retained.items() if _selected(n, iteration, name)}
        if not retained:
            asked = name or iteration_dir_name(iteration or 0)
            have = ", ".join(_label(n) for n in scan_iteration_dirs(directory / SNAPSHOTS_DIR)[0]) or "none"
            raise AxrlError(
                f"{directory / SNAPSHOTS_DIR / asked}: no retained snapshot for "
                f"{'snapshot ' + name if name else f'iteration {iteration}'} (retained: {have})"
            )
    if not retained and not refused:  # nothing to keep: an output dir without snapshots is left as it was
        return PreserveResult(output_dir=str(directory))
    target = _created_target(directory, Path(workspace) if workspace is not None else None, no_writes)
    preserved_root = target.root
    result = PreserveResult(
        output_dir=str(directory),
        preserved_root=str(preserved_root),
        in_workspace=target.in_workspace,
        reason=target.reason,
    )
    for entry in refused:  # an iter_<N> symlinked out of its dir: reported, never followed
        error = f"{entry.path} {entry.reason}; nothing was preserved"
        result.failed.append(PreserveFailure(entry.iteration or 0, entry.path, error))
    with held_lock(preserved_root / _LOCK_NAME, 300, f"preserved snapshots in {preserved_root}"):
        for dir_name, source in retained.items():
            it = parse_iteration(dir_name) or 0
            outcome = _preserve_one(source, preserved_root, it, result.skipped)
            if isinstance(outcome, PreservedCopy):
                result.preserved.append(outcome)
            else:
                result.failed.append(outcome)
            if progress is not None:
                status = outcome.status if isinstance(outcome, PreservedCopy) else "failed"
                progress(f"{_what(dir_name)}: {status} ({len(result.preserved) + len(result.failed)}/{len(retained)})")
    return result


def _selected(dir_name: str, iteration: int | None, name: str | None) -> bool:
    """Whether a snapshot dir is the one asked for: by name, else every dir of the iteration, else all."""
    if name is not None:
        return dir_name == name
    return iteration is None or parse_iteration(dir_name) == iteration


def _label(dir_name: str) -> str:
    """`41` for `iter_0000041`, `41-<tag>` for `iter_0000041-<tag>`."""
    parsed = parse_snapshot_name(dir_name)
    if parsed is None:
        return dir_name
    return str(parsed[0]) if parsed[1] is None else f"{parsed[0]}-{parsed[1]}"


def _what(dir_name: str) -> str:
    return f"iteration {_label(dir_name)}"


def _created_target(directory: Path, workspace: Path | None, no_writes: bool) -> PreserveTarget:
    """The preserved dir, created: `<output dir>/checkpoints/spike_snapshots-active` (it may be a symlink an admin
    made to another filesystem), or the workspace's when the output root is not to be written or cannot be (a
    read-only mount refuses even a superuser whom `os.access` let through: then the workspace is used too, when
    one is named)."""
    target = preserve_target(directory, workspace, no_writes)
    try:
        target.root.mkdir(parents=True, exist_ok=True)
        return target
    except OSError as exc:
        refused = exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
        if not refused or target.in_workspace or workspace is None:
            raise AxrlError(f"{target.root}: cannot create the preserved dir ({exc.strerror or exc})") from None
        reason = f"{target.root} cannot be created ({exc.strerror or exc})"
    fallback = PreserveTarget(_preserved_root(directory, workspace), True, reason)
    try:
        fallback.root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AxrlError(f"{fallback.root}: cannot create the preserved dir ({exc.strerror or exc})") from None
    return fallback


def _preserved_root(directory: Path, workspace: Path | None = None) -> Path:
    """Where the preserved copies of `directory` are: under it, or in `workspace` when given."""
    if workspace is not None:
        return Path(os.path.abspath(workspace)) / WORKSPACE_PRESERVED / directory.name
    return directory / PRESERVED_DIR


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


def release(
    output_dir: str | Path,
    iteration: int | None = None,
    *,
    name: str | None = None,
    workspace: str | Path | None = None,
) -> ReleaseResult:
    """Delete the preserved copies of `iteration` (every run's), or the one copy `name`, or every preserved copy
    when both are None; never anything else. With `workspace`: the copies `preserve` made there for this output
    dir instead of those under it.

    A copy that is not provably ours is refused: raises AxrlError for a requested iteration or name, or is
    listed in `refused` when releasing all. Retained snapshots are never touched.
    """
    directory = _output_dir(output_dir)
    preserved_root = _preserved_root(directory, Path(workspace) if workspace is not None else None)
    found, skipped = scan_iteration_dirs(preserved_root)
    iteration = parse_iteration(name) if name is not None else iteration
    wanted = iteration is not None
    if wanted:
        for entry in skipped:
            if _selected(Path(entry.path).name, iteration, name):
                raise AxrlError(f"{entry.path}: refused to delete: {entry.reason}")
        chosen = {n: path for n, path in found.items() if _selected(n, iteration, name)}
        if not chosen:
            asked = name or iteration_dir_name(iteration or 0)
            have = ", ".join(_label(n) for n in found) or "none"
            raise AxrlError(
                f"{preserved_root / asked}: no preserved copy for "
                f"{'snapshot ' + name if name else f'iteration {iteration}'} (preserved: {have})"
            )
        found = chosen
    result = ReleaseResult(output_dir=str(directory))
    if not wanted:
        result.refused += [RefusedRelease(entry.path, entry.reason) for entry in skipped]
    if not found:
        return result
    with held_lock(preserved_root / _LOCK_NAME, 300, f"preserved snapshots in {preserved_root}"):
        for dir_name, path in found.items():
            try:
                reason = _release_one(path, directory / SNAPSHOTS_DIR)
            except AxrlError as exc:
                if wanted:
                    raise
                result.refused.append(RefusedRelease(str(path), str(exc)))
                continue
            if reason is None:
                result.released.append(ReleasedCopy(parse_iteration(dir_name) or 0, str(path)))
            elif wanted:
                raise AxrlError(f"{path}: refused to delete: {reason}")
            else:
                result.refused.append(RefusedRelease(str(path), reason))
    return result
