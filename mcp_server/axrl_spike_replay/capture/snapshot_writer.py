"""Write a spike snapshot (format v1) atomically: it appears under `iter_<N>` complete or not at all."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from axrl_spike_replay.atomic import atomic_write_json, atomic_write_text
from axrl_spike_replay.errors import AxrlError
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
)
from axrl_spike_replay.snapshot.metadata import AxrlMetadata

if TYPE_CHECKING:
    import torch


@dataclass
class RankPayload:
    """What one data-parallel rank contributes to a snapshot."""

    batch: dict[str, torch.Tensor]
    grad_info: dict[str, Any]
    routing_payload: dict[str, Any] | None = None


def _dist_active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    import torch.distributed as dist

    if _dist_active():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _dist_active() else 0


def write_snapshot(
    snapshots_root: str | Path,
    metadata: AxrlMetadata,
    run_config: dict[str, Any],
    model_state: dict[str, torch.Tensor],
    ranks: dict[int, RankPayload],
    *,
    keep_last: int | None = None,
    legacy_layout: bool = False,
    weights_writer: Callable[[Path], None] | None = None,
) -> Path:
    """Write snapshot `iter_<N>` under `snapshots_root` and return its path.

    Under torch.distributed every rank calls this with its own `ranks` entry; otherwise one process
    passes every rank. Files go to a hidden temp dir that is renamed into place once complete, so an
    interrupted write never leaves anything under `iter_<N>`. `legacy_layout` writes the AXRL keys
    to `metadata.json` as old snapshots did (for tests and fixtures). `weights_writer(staging_dir)`, when
    given, writes the weights instead of `model_state` (collective: Megatron's `dist_checkpointing.save`, which
    writes its own `metadata.json`; that one is kept).
    """
    import torch
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    root = Path(snapshots_root)
    final = root / iteration_dir_name(metadata.iteration)
    staging = root / f".{final.name}.writing"
    if _rank() == 0:
        if final.exists():
            raise AxrlError(f"{final}: a snapshot for iteration {metadata.iteration} already exists")
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)  # left by an interrupted write of ours
        staging.mkdir()
    _barrier()

    if weights_writer is not None:
        weights_writer(staging)
    else:
        state = {f"model.{name}": tensor.detach().cpu() for name, tensor in model_state.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(state, checkpoint_id=str(staging), no_dist=not _dist_active())
    for rank, payload in ranks.items():
        torch.save(payload.batch, staging / batch_file(rank))
        torch.save(payload.grad_info, staging / grad_info_file(rank))
        if payload.routing_payload is not None:
            torch.save(payload.routing_payload, staging / routing_payload_file(rank))
    _barrier()

    if _rank() == 0:
        atomic_write_text(staging / RUN_CONFIG, yaml.safe_dump(run_config, sort_keys=False))
        if legacy_layout:
            atomic_write_json(staging / CHECKPOINT_METADATA, metadata.to_json())
        else:
            if weights_writer is None or not (staging / CHECKPOINT_METADATA).is_file():
                atomic_write_json(staging / CHECKPOINT_METADATA, CHECKPOINT_METADATA_CONTENT)
            atomic_write_json(staging / AXRL_METADATA, metadata.to_json())
        _fsync_dir(staging)
        os.rename(staging, final)
        _fsync_dir(root)
        if keep_last is not None:
            rotate_snapshots(root, keep_last)
    _barrier()
    return final


def rotate_snapshots(snapshots_root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` `iter_<N>` dirs under the rotating root; return the deleted."""
    if keep_last < 1:
        raise AxrlError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(snapshots_root)
    found = sorted(
        ((parse_iteration(p.name), p) for p in root.iterdir() if p.is_dir() and parse_iteration(p.name) is not None),
        key=lambda item: item[0] or 0,
    )
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
