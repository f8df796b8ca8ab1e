"""List an output dir's spike snapshots: the rotating (retained) ones and the preserved copies."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, SNAPSHOTS_DIR, parse_iteration
from axrl_spike_replay.snapshot.metadata import read_metadata


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


@dataclass
class SnapshotListing:
    """Snapshots of one output dir, by iteration (retained before preserved at the same iteration)."""

    output_dir: str
    snapshots: list[SnapshotEntry] = field(default_factory=list)


def iteration_dirs(parent: Path) -> dict[int, Path]:
    """{iteration: path} of the complete `iter_<N>` dirs in `parent` (hidden staging dirs are ignored)."""
    if not parent.is_dir():
        return {}
    found = {}
    for entry in parent.iterdir():
        iteration = parse_iteration(entry.name)
        if iteration is not None and entry.is_dir():
            found[iteration] = entry
    return dict(sorted(found.items()))


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
    try:
        meta, legacy = read_metadata(path)
    except SnapshotError as exc:
        entry.problem = str(exc)
        return entry
    entry.spike_ratio = meta.spike_ratio
    entry.grad_norm = meta.grad_norm
    entry.legacy_metadata = legacy
    return entry


def list_snapshots(output_dir: str | Path) -> SnapshotListing:
    """Retained (`checkpoints/spike_snapshots/`) and preserved (`checkpoints/spike_snapshots-active/`) snapshots."""
    directory = Path(os.path.abspath(output_dir))
    if not directory.is_dir():
        raise AxrlError(f"{directory}: output directory not found")
    listing = SnapshotListing(output_dir=str(directory))
    for preserved, sub in ((False, SNAPSHOTS_DIR), (True, PRESERVED_DIR)):
        for iteration, path in iteration_dirs(directory / sub).items():
            listing.snapshots.append(_entry(path, iteration, preserved))
    listing.snapshots.sort(key=lambda e: (e.iteration, e.preserved))
    return listing
