"""Write a spike snapshot (format v1) atomically: it appears under `iter_<N>` complete or not at all.

Under torch.distributed the write is collective and every rank ends it the same way: rank 0 picks a free name and
makes a hidden staging dir, every rank writes its files into it, rank 0 completes it and renames it into place.
Between the parts the ranks agree on how each went (`rank_agreement.agree`), so a failure on any rank (a full
disk, an unwritable dir, a payload that will not pickle) makes every rank raise `SnapshotWriteError` at the same
point, no rank waits at a barrier for a peer that left, and the staging dir is removed: nothing is left behind.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from axrl_spike_replay.capture.checkpoint_writer import save_model_checkpoint
from axrl_spike_replay.capture.rank_agreement import agree, describe, failures
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.files.atomic import atomic_write_json, atomic_write_text
from axrl_spike_replay.snapshot.layout import (
    AXRL_METADATA,
    CHECKPOINT_METADATA,
    CHECKPOINT_METADATA_CONTENT,
    RUN_CONFIG,
    batch_file,
    grad_info_file,
    iteration_dir_name,
    parse_iteration,
    routing_payload_file,
    snapshot_order,
)
from axrl_spike_replay.snapshot.metadata import AxrlMetadata

if TYPE_CHECKING:
    import torch

log = logging.getLogger("axrl_spike_replay.guard")
MAX_NAME_TRIES = 1000  # `iter_<N>-<tag>.2`, `.3`, ...: a root holding this many snapshots of one name is not sane


class SnapshotWriteError(AxrlError):
    """A snapshot could not be written (on this rank or another); raised on every rank alike, nothing left behind.
    `errors` holds each rank's error (None where the rank's part went well)."""

    def __init__(self, message: str, errors: list[str | None] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


@dataclass
class RankPayload:
    """What one data-parallel rank contributes to a snapshot."""

    batch: dict[str, Any]  # a dict of tensors, or {"micro_batches": [dict of tensors, ...]}
    grad_info: dict[str, Any]
    routing_payload: dict[str, Any] | None = None


def _dist_active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _dist_active() else 0


def free_snapshot_name(root: Path, iteration: int, tag: str | None = None) -> str:
    """`iter_<N>[-<tag>]`, or when a snapshot of that name exists (a restarted run, two updates in one step) the
    first free `iter_<N>-<tag>.<k>` (`iter_<N>-<k>` untagged), k = 2, 3, ...: an existing snapshot is never
    overwritten and a collision never fails the write."""
    for k in range(1, MAX_NAME_TRIES + 1):
        if k == 1:
            name = iteration_dir_name(iteration, tag)
        else:
            name = iteration_dir_name(iteration, f"{tag}.{k}" if tag else str(k))
        if not os.path.lexists(root / name):
            return name
    raise SnapshotWriteError(f"{root}: {MAX_NAME_TRIES} snapshots named for iteration {iteration} already exist")


def _open_staging(root: Path, iteration: int, tag: str | None) -> str:
    """Rank 0: make the root and the hidden staging dir of a free name; the name."""
    root.mkdir(parents=True, exist_ok=True)
    name = free_snapshot_name(root, iteration, tag)
    staging = root / f".{name}.writing"
    if staging.is_symlink() or staging.is_file():
        staging.unlink()
    elif staging.exists():
        shutil.rmtree(staging)  # left by an interrupted write of ours
    staging.mkdir()
    return name


def _abandon(staging: Path | None) -> None:
    """Rank 0: remove a staging dir after a failed write (a later snapshot sweeps what cannot be removed now)."""
    if staging is not None and _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)


def write_snapshot(
    snapshots_root: str | Path,
    metadata: AxrlMetadata,
    run_config: Mapping[str, Any],
    model_state: Mapping[str, torch.Tensor],
    ranks: Mapping[int, RankPayload],
    *,
    keep_last: int | None = None,
    legacy_layout: bool = False,
    tag: str | None = None,
    local_error: str | None = None,
    weights_writer: Callable[[Path], None] | None = None,
) -> Path:
    """Write snapshot `iter_<N>` (`iter_<N>-<tag>` with a tag; see `free_snapshot_name` when it exists) under
    `snapshots_root` and return its path.

    Under torch.distributed every rank calls this with its own `ranks` entry; otherwise one process
    passes every rank. `local_error` says this rank could not collect its part (the write is then abandoned on
    every rank). Files go to a hidden temp dir that is renamed into place once complete, so an interrupted write
    never leaves anything under `iter_<N>`; a failed one leaves nothing at all and raises `SnapshotWriteError` on
    every rank. `legacy_layout` writes the AXRL keys to `metadata.json` as old snapshots did (for tests and
    fixtures). `weights_writer(staging_dir)`, when given, writes the weights instead of `model_state` (collective:
    Megatron's `dist_checkpointing.save`, which writes its own `metadata.json`; that one is kept).
    """

    root = Path(snapshots_root)
    rank = _rank()
    state: dict[str, Any] = {}
    error = local_error
    if error is None:
        try:
            state = {f"model.{name}": tensor.detach().cpu() for name, tensor in model_state.items()}
        except Exception as exc:  # any failure of a rank's own part: told to every rank, which then all stop
            error = f"the model state: {describe(exc)}"
    name: str | None = None
    if rank == 0 and error is None:
        try:
            name = _open_staging(root, metadata.iteration, tag)
        except Exception as exc:
            error = describe(exc)
    outcomes = agree((name, error))
    name = outcomes[0][0]
    staging = root / f".{name}.writing" if name is not None else None
    _settle([e for _, e in outcomes], staging, root, metadata.iteration)
    assert name is not None and staging is not None  # rank 0 opened it, or _settle raised
    final = root / name

    error = None
    try:
        if weights_writer is not None:
            weights_writer(staging)
        else:  # records the snapshot's name as the checkpoint id, not the staging path
            save_model_checkpoint(state, staging, name=final.name, distributed=_dist_active())
        for r, payload in ranks.items():
            _save(payload.batch, staging / batch_file(r))
            _save(payload.grad_info, staging / grad_info_file(r))
            if payload.routing_payload is not None:
                _save(payload.routing_payload, staging / routing_payload_file(r))
    except (Exception, _checkpoint_exception()) as exc:  # DCP's CheckpointException is a BaseException
        error = describe(exc) + _space_note(staging, state, ranks)
    _settle(agree(error), staging, root, metadata.iteration)

    error = None
    if rank == 0:
        try:
            atomic_write_text(staging / RUN_CONFIG, yaml.safe_dump(dict(run_config), sort_keys=False))
            if legacy_layout:
                atomic_write_json(staging / CHECKPOINT_METADATA, metadata.to_json())
            else:
                if weights_writer is None or not (staging / CHECKPOINT_METADATA).is_file():
                    atomic_write_json(staging / CHECKPOINT_METADATA, CHECKPOINT_METADATA_CONTENT)
                atomic_write_json(staging / AXRL_METADATA, metadata.to_json())
            _fsync_dir(staging)
            os.rename(staging, final)
        except Exception as exc:
            error = describe(exc) + _space_note(staging, {}, {})
    _settle(agree(error), staging, root, metadata.iteration)
    if rank == 0:
        _after_rename(root, final, keep_last)
    return final


def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _save(obj: Any, path: Path) -> None:
    """torch.save through our own write: a full disk then raises OSError(ENOSPC) naming the file, where torch's
    zip writer reports only `unexpected pos` (the payloads are a rank's batch and norms: small, held in memory)."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        with open(path, "wb") as handle:
            handle.write(buffer.getbuffer())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def _tensor_bytes(value: Any) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, torch.Tensor):
        local = value.to_local() if isinstance(value, DTensor) else value
        return 0 if local.is_nested else local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _space_note(staging: Path, state: Mapping[str, Any], ranks: Mapping[int, RankPayload]) -> str:
    """` (about N MB to write, M MB free on its filesystem)` when the free space is short of this rank's part
    (nothing otherwise): a full disk reads as one, even where the error itself (torch's zip writer) does not."""
    needed = _tensor_bytes(dict(state)) + sum(_tensor_bytes([p.batch, p.routing_payload]) for p in ranks.values())
    try:
        info = os.statvfs(staging.parent)
    except OSError:
        return ""
    free = info.f_bavail * info.f_frsize
    if free >= max(needed, 1 << 20):
        return ""
    return f" (about {needed / 1e6:.3g} MB to write, {free / 1e6:.3g} MB free on its filesystem)"


def _settle(errors: list[str | None], staging: Path | None, root: Path, iteration: int) -> None:
    """Go on when every rank succeeded; else remove the staging dir (rank 0) and raise on every rank."""
    failed = failures(errors)
    if failed is None:
        return
    _abandon(staging)
    agree(None)  # every rank returns once the staging dir is gone: none sees it half-removed
    raise SnapshotWriteError(f"{root}: the snapshot of iteration {iteration} was not written ({failed})", errors)


def _after_rename(root: Path, final: Path, keep_last: int | None) -> None:
    """Rank 0, once the snapshot is in place: make the rename durable and rotate. A failure here leaves a complete
    snapshot, so it is logged, never raised."""
    try:
        _fsync_dir(root)
        if keep_last is not None:
            rotate_snapshots(root, keep_last)
    except OSError as exc:
        log.warning("%s is written, but rotating %s failed: %s", final.name, root, describe(exc))


def rotate_snapshots(snapshots_root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` snapshot dirs under the rotating root; return the deleted.

    Newest by when they were written (the dir's modification time, then the iteration): a restarted run's
    snapshots are newer than a previous run's at higher iterations. Symlinks are never followed or deleted."""
    if keep_last < 1:
        raise AxrlError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(snapshots_root)
    found = []
    for path in root.iterdir():
        if parse_iteration(path.name) is None or path.is_symlink() or not path.is_dir():
            continue
        found.append(((path.stat().st_mtime_ns, snapshot_order(path.name)), path))
    found.sort(key=lambda item: item[0])
    doomed = [path for _, path in found[:-keep_last]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
