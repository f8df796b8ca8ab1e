"""Is a snapshot directory complete? The files format v1 requires, checked by name (no tensor data read)."""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.checkpoint import read_checkpoint_metadata
from axrl_spike_replay.snapshot.layout import DCP_METADATA, batch_file, grad_info_file
from axrl_spike_replay.snapshot.metadata import read_metadata


def checkpoint_data_files(snapshot_dir: str | Path) -> list[str]:
    """Relative paths of the `.distcp` files the checkpoint's `.metadata` refers to."""
    metadata = read_checkpoint_metadata(snapshot_dir, records=True)
    storage = getattr(metadata, "storage_data", None) or {}
    return sorted({str(info.relative_path) for info in storage.values()})


def missing_required(snapshot_dir: str | Path) -> list[str]:
    """What a usable snapshot needs and this one lacks: metadata, the checkpoint and its data files, and
    a batch and grad-info file for every rank of the saved world size. Empty when complete."""
    directory = Path(snapshot_dir)
    try:
        meta, _ = read_metadata(directory)
    except SnapshotError as exc:
        return [str(exc)]
    missing: list[str] = []
    for rank in range(meta.parallel.world_size):
        for name in (batch_file(rank), grad_info_file(rank)):
            if not (directory / name).is_file():
                missing.append(f"{directory / name}: missing (world size {meta.parallel.world_size})")
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
