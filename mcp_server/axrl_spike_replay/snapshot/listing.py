"""List an output dir's spike snapshots: the rotating (retained) ones and the preserved copies."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.snapshot.layout import (
    AXRL_METADATA,
    CHECKPOINT_METADATA,
    PRESERVED_DIR,
    SNAPSHOTS_DIR,
    WORKSPACE_PRESERVED,
    parse_iteration,
    snapshot_order,
)
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.untrusted.containment import is_inside, link_leaving


@dataclass
class SnapshotEntry:
    """One snapshot directory. `spike_ratio`/`grad_norm` are None when its metadata is unreadable (`problem`)."""

    iteration: int
    path: str
    bytes: int
    spike_ratio: float | None
    preserved: bool
    grad_norm: float | None = None
    legacy_metadata: bool = False
    problem: str | None = None
    in_workspace: bool = False  # a preserved copy in the workspace (`preserve --into-workspace`), not the output root


@dataclass
class SkippedEntry:
    """An entry not followed: a symlink that leads out of the tree being read or written."""

    path: str
    reason: str
    iteration: int | None = None


@dataclass
class RankedSnapshot:
    """Where a snapshot stands in the order to investigate: 1 first (the largest spike ratio)."""

    order: int
    iteration: int
    path: str
    spike_ratio: float | None
    reason: str


@dataclass
class SnapshotListing:
    """Snapshots of one output dir, by iteration and name (retained before preserved of the same name).

    A snapshot dir that is a symlink leading out of its snapshots dir is not followed: it is listed
    in `skipped` with the reason. `ranking` orders the iterations to investigate (see `rank_snapshots`).
    """

    output_dir: str
    snapshots: list[SnapshotEntry] = field(default_factory=list)
    skipped: list[SkippedEntry] = field(default_factory=list)
    ranking: list[RankedSnapshot] = field(default_factory=list)


def rank_snapshots(snapshots: list[SnapshotEntry]) -> list[RankedSnapshot]:
    """One entry per snapshot name, largest spike ratio first: start with the strongest, confirm on the others.

    The preserved copy stands for its snapshot where there is one (rotation cannot take it away); two runs'
    snapshots of one iteration (`iter_<N>-<run id>`) are two entries. Snapshots whose metadata cannot be read
    come last, with the problem as the reason.
    """
    chosen: dict[str, SnapshotEntry] = {}
    for entry in snapshots:  # sorted retained-then-preserved, so a preserved copy replaces its source
        name = Path(entry.path).name
        if entry.problem is None or name not in chosen:
            chosen[name] = entry
    readable = [e for e in chosen.values() if e.spike_ratio is not None and e.problem is None]
    readable.sort(key=lambda e: (-_finite_or_inf(e.spike_ratio), snapshot_order(Path(e.path).name)))
    unreadable = sorted(
        (e for e in chosen.values() if e not in readable), key=lambda e: snapshot_order(Path(e.path).name)
    )
    ranked: list[RankedSnapshot] = []
    for order, entry in enumerate(readable, start=1):
        finite = entry.spike_ratio is not None and math.isfinite(entry.spike_ratio)
        ratio = f"spike ratio {entry.spike_ratio:.4g}x the median" if finite else "non-finite grad norm (NaN or inf)"
        if order == 1 and len(readable) > 1:
            reason = f"start here: the largest {ratio}" if finite else f"start here: a {ratio}, the largest spike"
        elif order == 1:
            reason = f"start here: the only readable snapshot ({ratio})"
        else:
            reason = f"{ratio}: confirm the diagnosis and the method on it"
        ranked.append(
            RankedSnapshot(
                order=order, iteration=entry.iteration, path=entry.path, spike_ratio=entry.spike_ratio, reason=reason
            )
        )
    for order, entry in enumerate(unreadable, start=len(ranked) + 1):
        problem = f"metadata not usable: {entry.problem}"
        ranked.append(
            RankedSnapshot(order=order, iteration=entry.iteration, path=entry.path, spike_ratio=None, reason=problem)
        )
    return ranked


def _finite_or_inf(ratio: float | None) -> float:
    """A non-finite ratio (a NaN or inf grad norm) is the strongest spike of all."""
    return float("inf") if ratio is None or ratio != ratio else ratio


def scan_iteration_dirs(parent: Path, root: Path | None = None) -> tuple[dict[str, Path], list[SkippedEntry]]:
    """({name: path} of the `iter_<N>` and `iter_<N>-<tag>` dirs in `parent`, by iteration then name; the entries
    skipped and why). `parse_iteration(name)` gives a dir's iteration.

    Nothing is followed out of `root` (default: `parent`): a `parent` or an `iter_<N>` that is a
    symlink leading outside it is skipped, never read. Hidden staging dirs are ignored.
    """
    root = parent if root is None else root
    if not parent.is_dir():
        return {}, []
    if not is_inside(parent, root):
        reason = f"leads outside {root} (to {parent.resolve()}) through a symlink; not followed"
        return {}, [SkippedEntry(str(parent), reason)]
    found, skipped = {}, []
    for entry in parent.iterdir():
        iteration = parse_iteration(entry.name)
        if iteration is None:
            continue
        leaving = link_leaving(entry, root)
        if leaving is not None:
            skipped.append(SkippedEntry(str(entry), f"{leaving}; not followed", iteration))
        elif entry.is_dir():
            found[entry.name] = entry
    skipped.sort(key=lambda s: s.path)
    return dict(sorted(found.items(), key=lambda item: snapshot_order(item[0]))), skipped


def directory_bytes(path: Path) -> int:
    """Apparent size of every file below `path` (hardlinked files count in each copy)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # rotated away while we looked
                continue
    return total


def _entry(path: Path, iteration: int, preserved: bool) -> SnapshotEntry:
    entry = SnapshotEntry(
        iteration=iteration, path=str(path), bytes=directory_bytes(path), spike_ratio=None, preserved=preserved
    )
    for name in (AXRL_METADATA, CHECKPOINT_METADATA):
        leaving = link_leaving(path / name, path)
        if leaving is not None:  # never read a file outside the snapshot (a device, someone's secrets)
            entry.problem = f"{path / name} {leaving}; not read"
            return entry
    try:
        meta, legacy = read_metadata(path)
    except SnapshotError as exc:
        entry.problem = str(exc)
        return entry
    entry.spike_ratio = meta.spike_ratio
    entry.grad_norm = meta.grad_norm
    entry.legacy_metadata = legacy
    return entry


def list_snapshots(output_dir: str | Path, workspace: str | Path | None = None) -> SnapshotListing:
    """Retained (`checkpoints/spike_snapshots/`) and preserved (`checkpoints/spike_snapshots-active/`) snapshots, and
    with `workspace` the copies preserved into it for this output dir (`in_workspace`; a copy whose marker names
    another output dir as its source is skipped, with the reason)."""
    directory = Path(os.path.abspath(output_dir))
    if not directory.is_dir():
        raise AxrlError(f"{directory}: output directory not found")
    listing = SnapshotListing(output_dir=str(directory))
    for preserved, sub in ((False, SNAPSHOTS_DIR), (True, PRESERVED_DIR)):
        found, skipped = scan_iteration_dirs(directory / sub)
        for name, path in found.items():
            listing.snapshots.append(_entry(path, parse_iteration(name) or 0, preserved))
        listing.skipped += skipped
    if workspace is not None:
        _add_workspace_copies(listing, directory, Path(os.path.abspath(workspace)))
    listing.snapshots.sort(key=lambda e: (snapshot_order(Path(e.path).name), e.preserved, e.in_workspace))
    listing.ranking = rank_snapshots(listing.snapshots)
    return listing


def _add_workspace_copies(listing: SnapshotListing, directory: Path, workspace: Path) -> None:
    """The copies `preserve` made of `directory`'s snapshots in `workspace` (`preserved-snapshots/<dir name>/`)."""
    from axrl_spike_replay.snapshot.preservation.preserved_marker import read_marker

    parent = workspace / WORKSPACE_PRESERVED / directory.name
    found, skipped = scan_iteration_dirs(parent, root=workspace)
    listing.skipped += skipped
    for name, path in found.items():
        marker, _ = read_marker(path)
        source = str(marker.get("source") or "") if marker else ""
        if source and not _is_under(Path(source), directory):
            why = f"a workspace copy of another output dir's snapshot ({source}); not listed here"
            listing.skipped.append(SkippedEntry(str(path), why, parse_iteration(name)))
            continue
        entry = _entry(path, parse_iteration(name) or 0, True)
        entry.in_workspace = True
        listing.snapshots.append(entry)


def _is_under(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
    except (OSError, ValueError):
        return False
    return True
