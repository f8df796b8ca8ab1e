"""Is a snapshot directory complete? The files format v1 requires, checked by name (no tensor data read).

A declared world size is bounded by what is on disk: missing ranks are computed from the rank files
present and reported as ranges (`2-999999999`), so a metadata file claiming 10^9 ranks costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.dcp.checkpoint import read_checkpoint_metadata
from axrl_spike_replay.snapshot.layout import DCP_METADATA, rank_files
from axrl_spike_replay.snapshot.metadata import read_metadata

MAX_RANGES_SHOWN = 8  # rank ranges listed in one message; the rest are counted


def missing_ranks(present: Iterable[int], world_size: int) -> list[tuple[int, int]]:
    """Inclusive ranges of ranks in [0, world_size) absent from `present`; cost grows with `present` only."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for rank in sorted(r for r in set(present) if 0 <= r < world_size):
        if rank > start:
            ranges.append((start, rank - 1))
        start = rank + 1
    if start < world_size:
        ranges.append((start, world_size - 1))
    return ranges


def rank_ranges_text(ranges: list[tuple[int, int]]) -> str:
    """`[1]`, `[2, 3]`, `[2-999999999]`: at most MAX_RANGES_SHOWN ranges, then how many ranks more."""
    parts = []
    for low, high in ranges[:MAX_RANGES_SHOWN]:
        if high - low >= 2:
            parts.append(f"{low}-{high}")
        else:
            parts += [str(r) for r in range(low, high + 1)]
    rest = sum(high - low + 1 for low, high in ranges[MAX_RANGES_SHOWN:])
    return "[" + ", ".join(parts) + (f", ... {rest} more" if rest else "") + "]"


def ranks_text(ranks: Iterable[int]) -> str:
    """A set of ranks, compactly: consecutive runs as ranges, bounded length."""
    ordered = sorted(set(ranks))
    ranges: list[tuple[int, int]] = []
    for rank in ordered:
        if ranges and ranges[-1][1] == rank - 1:
            ranges[-1] = (ranges[-1][0], rank)
        else:
            ranges.append((rank, rank))
    return rank_ranges_text(ranges)


def checkpoint_data_files(snapshot_dir: str | Path) -> list[str]:
    """Relative paths of the `.distcp` files the checkpoint's `.metadata` refers to."""
    metadata = read_checkpoint_metadata(snapshot_dir, records=True)
    return sorted({str(info.relative_path) for info in metadata.storage_data.values()})


def missing_required(snapshot_dir: str | Path) -> list[str]:
    """What a usable snapshot needs and this one lacks: metadata, the checkpoint and its data files, and
    a batch and grad-info file for every rank of the saved world size. Empty when complete."""
    directory = Path(snapshot_dir)
    try:
        meta, _ = read_metadata(directory)
    except SnapshotError as exc:
        return [str(exc)]
    world = meta.parallel.data_ranks
    files = rank_files(directory)
    missing: list[str] = []
    for kind in ("batch", "grad_info"):
        ranges = missing_ranks(files[kind], world)
        if ranges:
            missing.append(
                f"{directory}: no {kind}_rank<r>.pt for ranks {rank_ranges_text(ranges)} (world size {world})"
            )
    if not (directory / DCP_METADATA).is_file():
        missing.append(f"{directory / DCP_METADATA}: missing (no checkpoint weights)")
        return missing
    try:
        data_files = checkpoint_data_files(directory)
    except SnapshotError as exc:
        return [*missing, str(exc)]
    missing += [
        f"{directory / name}: missing (named by the checkpoint metadata)"
        for name in data_files
        if not (directory / name).is_file()
    ]
    return missing
