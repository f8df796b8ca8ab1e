"""A Megatron-core `torch_dist` checkpoint, read from its headers: format, tensors, saved layout, coverage, regions.

Megatron's `dist_checkpointing.save` writes `metadata.json` (`{"sharded_backend": "torch_dist", ...}`), DCP's
`.metadata`, one `__<rank>_<thread>.distcp` per writing thread and `common.pt` (the state dict's non-sharded
items). Its keys are global: layers stacked on a leading axis (`decoder.layers.self_attention.linear_qkv.weight`
[L, ...]), experts on a second one (`decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H]), and
every shard a chunk at its global offset. So the tensor-parallel sizes show in the chunks (`linear_qkv` split
along its output rows: TP; the experts' `linear_fc2` along its input columns: ETP), and which data file holds each
layer shows which pipeline stage's files a checkpoint needs. Expert, pipeline and data-parallel sizes leave no
trace in the chunks (experts and layers are one chunk each whatever the layout): they come from the snapshot's
metadata and run config. Where layers differ (DeepSeek-V3's dense first layers: a `moe_layer_freq` list),
megatron-core saves each layer under its own key instead (`decoder.layers.<i>.…`, experts [E, ...]); those are
read the same way, the layer index taken from the key.

Everything is read as untrusted: `.metadata` through `snapshot.dcp.checkpoint`'s allowlisted unpickler (sizes bounded
by the data files), `metadata.json` bounded, `common.pt` with `weights_only=True`. `load_regions` reads any
rectangular region of any tensor into a tensor the caller allocated (DCP reads just the chunks that overlap it).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.dcp.checkpoint import (
    check_checkpoint_storage,
    read_checkpoint_metadata,
    safe_reader,
    summarize_checkpoint,
)
from axrl_spike_replay.snapshot.layout import CHECKPOINT_METADATA, CHECKPOINT_METADATA_CONTENT, DCP_METADATA
from axrl_spike_replay.snapshot.metadata import is_legacy_layout, read_json_document

if TYPE_CHECKING:
    import torch

    from axrl_spike_replay.snapshot.metadata import ParallelLayout

BACKEND = "torch_dist"
BACKEND_VERSIONS = (1,)  # what megatron-core 0.7-0.16 write
COMMON_STATE = "common.pt"
LAYERS = "decoder.layers."
QKV = "decoder.layers.self_attention.linear_qkv.weight"
EXPERT_FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
COMMAND_BACKEND_HINT = "replay it with `--backend command` and the trainer's own replay command"
_DATA_FILE_RE = re.compile(r"__(\d+)_(\d+)\.distcp")
_PER_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.*)")  # a layer saved under its own key (non-homogeneous)
# Megatron-LM's common.pt can carry its argparse Namespace and RNG states besides plain containers.
COMMON_ALLOWED = ("argparse.Namespace",)


@dataclass(frozen=True)
class MegatronCheckpoint:
    """What a Megatron `torch_dist` checkpoint declares, read without any tensor data."""

    directory: str
    backend: str
    backend_version: int
    common_backend: str | None
    tensors: dict[str, tuple[tuple[int, ...], str]]  # global key -> (global shape, dtype)
    num_layers: int | None  # the leading axis of the stacked `decoder.layers.` keys
    num_experts: int | None
    tp: int | None  # from the chunks of linear_qkv (None: no such key)
    etp: int | None  # from the chunks of the experts' linear_fc2
    writer_ranks: tuple[int, ...]  # ranks that wrote a data file
    layer_files: dict[int, tuple[str, ...]] = field(default_factory=dict)  # layer -> data files holding a part of it
    bytes: int = 0

    @property
    def stacked(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The layer-stacked tensors (keys under `decoder.layers.`, per-layer keys left out)."""
        return {k: v for k, v in self.tensors.items() if k.startswith(LAYERS) and not _PER_LAYER_RE.fullmatch(k)}


def read_backend(directory: Path) -> dict[str, Any]:
    """Megatron's `metadata.json` of a checkpoint dir; SnapshotError unless it names a backend we read."""
    path = directory / CHECKPOINT_METADATA
    if not path.is_file():
        raise SnapshotError(f"{path}: missing (a Megatron checkpoint records its backend there)")
    doc = read_json_document(path)
    if "sharded_backend" not in doc and is_legacy_layout(directory):
        doc = dict(CHECKPOINT_METADATA_CONTENT)  # AXRL keys in Megatron's file: what snapshot.legacy restores
    backend, version = doc.get("sharded_backend"), doc.get("sharded_backend_version")
    if backend != BACKEND:
        raise SnapshotError(
            f"{path}: sharded_backend {shown(backend, 40)} is not read (read: {BACKEND}; zarr checkpoints come "
            f"from megatron-core before 0.7); {COMMAND_BACKEND_HINT}"
        )
    if isinstance(version, bool) or version not in BACKEND_VERSIONS:
        raise SnapshotError(
            f"{path}: sharded_backend_version {shown(version, 40)} of {BACKEND} is not read (read: "
            f"{', '.join(map(str, BACKEND_VERSIONS))}); {COMMAND_BACKEND_HINT}"
        )
    return doc


def is_megatron_checkpoint(directory: str | Path) -> bool:
    """Whether the dir holds a checkpoint written by Megatron's dist_checkpointing (global keys, no `model.`)."""
    path = Path(directory)
    if not (path / DCP_METADATA).is_file() or not (path / CHECKPOINT_METADATA).is_file():
        return False
    try:
        names = summarize_checkpoint(path).shapes
    except SnapshotError:
        return False
    return any(n.startswith(LAYERS) or n == "embedding.word_embeddings.weight" for n in names)


def _offset(index: Any) -> tuple[int, ...] | None:
    offset = getattr(index, "offset", None)
    return tuple(int(d) for d in offset) if offset is not None else None


def _splits(item: Any, dim: int, fixed: Sequence[int]) -> int | None:
    """How many chunks split dim `dim` of a tensor where the leading dims equal `fixed` (one layer, one expert)."""
    starts = {
        int(chunk.offsets[dim])
        for chunk in item.chunks
        if all(int(chunk.offsets[i]) == v for i, v in enumerate(fixed)) and len(chunk.offsets) > dim
    }
    return len(starts) or None


def read_megatron_checkpoint(directory: str | Path) -> MegatronCheckpoint:
    """The checkpoint's format, tensors and what its chunks say of the saved layout. Reads headers only."""
    path = Path(directory)
    backend = read_backend(path)
    metadata = read_checkpoint_metadata(path, records=True)
    summary = summarize_checkpoint(path)
    items = metadata.state_dict_metadata
    per_layer = {k: m for k in summary.shapes if (m := _PER_LAYER_RE.fullmatch(k))}
    stacked = [s for n, (s, _) in summary.shapes.items() if n.startswith(LAYERS) and s and n not in per_layer]
    layers = {shape[0] for shape in stacked}
    if per_layer:
        layers.add(1 + max(int(m.group(1)) for m in per_layer.values()))
    if len(layers) > 1:
        raise SnapshotError(f"{path / DCP_METADATA}: the stacked decoder.layers.* keys disagree on the layer count")
    num_layers = layers.pop() if layers else None
    fc2 = summary.shapes.get(EXPERT_FC2)
    num_experts = fc2[0][1] if fc2 and len(fc2[0]) == 4 else None
    tp = _splits(items[QKV], 1, (0,)) if QKV in items else None
    etp = _splits(items[EXPERT_FC2], 3, (0, 0)) if EXPERT_FC2 in items else None
    for key, match in sorted(per_layer.items(), key=lambda kv: int(kv[1].group(1))):
        name = match.group(2)
        if name == "mlp.experts.experts.linear_fc2.weight" and etp is None:  # [E, H, F], ETP splits F
            num_experts, etp = summary.shapes[key][0][0], _splits(items[key], 2, (0,))
        if name == "self_attention.linear_proj.weight" and tp is None:  # row-parallel: TP splits its input columns
            tp = _splits(items[key], 1, ())
    writers: set[int] = set()
    layer_files: dict[int, set[str]] = {}
    files: set[str] = set()
    for index, info in metadata.storage_data.items():
        files.add(info.relative_path)
        offset = _offset(index)
        if (match := _PER_LAYER_RE.fullmatch(index.fqn)) is not None:
            layer_files.setdefault(int(match.group(1)), set()).add(info.relative_path)
        elif index.fqn.startswith(LAYERS) and offset:
            layer_files.setdefault(offset[0], set()).add(info.relative_path)
    for name in files:
        match = _DATA_FILE_RE.fullmatch(name)
        if match:
            writers.add(int(match.group(1)))
    return MegatronCheckpoint(
        directory=str(path),
        backend=str(backend["sharded_backend"]),
        backend_version=int(backend["sharded_backend_version"]),
        common_backend=backend.get("common_backend") if isinstance(backend.get("common_backend"), str) else None,
        tensors=summary.shapes,
        num_layers=num_layers,
        num_experts=num_experts,
        tp=tp,
        etp=etp,
        writer_ranks=tuple(sorted(writers)),
        layer_files={layer: tuple(sorted(files)) for layer, files in sorted(layer_files.items())},
        bytes=summary.bytes,
    )


def _stage_of(layer: int, num_layers: int, pp: int) -> int:
    per_stage = max(1, num_layers // pp)
    return min(layer // per_stage, pp - 1)


def layout_problems(ckpt: MegatronCheckpoint, layout: ParallelLayout) -> list[str]:
    """Where the checkpoint disagrees with the saved layout (the snapshot's metadata / run config) or lacks the
    data files of a pipeline stage; empty when it fits. Reads nothing but file sizes."""
    where = Path(ckpt.directory) / DCP_METADATA
    problems: list[str] = []
    if ckpt.tp is not None and ckpt.tp != layout.tp:
        attention = "linear_qkv" if QKV in ckpt.tensors else "linear_proj"  # MLA has no fused QKV
        problems.append(
            f"{where}: {attention} is saved in {ckpt.tp} tensor-parallel shards but the snapshot's layout says "
            f"tp={layout.tp}"
        )
    if ckpt.etp is not None and ckpt.etp != layout.etp:
        problems.append(
            f"{where}: the experts' linear_fc2 is saved in {ckpt.etp} expert-tensor-parallel shards but the "
            f"snapshot's layout says etp={layout.etp}"
        )
    beyond = [rank for rank in ckpt.writer_ranks if rank >= layout.world_size]
    if beyond:
        problems.append(
            f"{where}: data files written by ranks {beyond[:8]} but the snapshot's world size is {layout.world_size}"
        )
    if ckpt.num_experts is not None and ckpt.num_experts % layout.ep:
        problems.append(f"{where}: {ckpt.num_experts} experts cannot be split over ep={layout.ep}")
    directory = Path(ckpt.directory)
    missing_files = {name for files in ckpt.layer_files.values() for name in files if not (directory / name).is_file()}
    if missing_files and ckpt.num_layers:
        lost = sorted(layer for layer, files in ckpt.layer_files.items() if set(files) & missing_files)
        stages = sorted({_stage_of(layer, ckpt.num_layers, layout.pp) for layer in lost})
        problems.append(
            f"{directory}: layers {lost} (pipeline stage {', '.join(map(str, stages))} of pp={layout.pp}) are stored "
            f"in {', '.join(sorted(missing_files))}, which {'is' if len(missing_files) == 1 else 'are'} missing; "
            f"restore the stage's files, or {COMMAND_BACKEND_HINT}"
        )
    if ckpt.num_layers:
        absent = [layer for layer in range(ckpt.num_layers) if layer not in ckpt.layer_files]
        if absent:
            problems.append(f"{where}: no stored chunk for layers {absent[:16]} of {ckpt.num_layers}")
    return problems


def read_common_state(directory: str | Path) -> Any:
    """`common.pt` (the checkpoint's non-sharded state: empty for a bare model, Megatron-LM's args and iteration
    beside it), loaded with `weights_only=True`; Megatron-LM's argparse Namespace is the one class allowed."""
    import argparse

    from axrl_spike_replay.snapshot.safe_load import load_pt

    path = Path(directory) / COMMON_STATE
    if not path.is_file():
        raise SnapshotError(f"{path}: missing (Megatron writes the checkpoint's common state there)")
    return load_pt(path, allowed_globals=[argparse.Namespace])


def load_regions(directory: str | Path, regions: Mapping[str, tuple[Sequence[int], torch.Tensor]]) -> None:
    """Fill each target tensor with the region of the checkpoint tensor `key` that starts at `offsets` and has
    the target's shape: `{key: (offsets, target)}`. DCP reads only the chunks overlapping each region, so a
    layer (or one expert) of a stacked key costs its own bytes. The caller bounds the storage once
    (`check_checkpoint_storage`); shapes and dtypes are checked here before anything is read."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    path = Path(directory)
    shapes = summarize_checkpoint(path).shapes
    for key, (offsets, target) in regions.items():
        if key not in shapes:
            raise SnapshotError(f"{path}: the checkpoint has no tensor {shown(key, 120)}")
        shape, dtype = shapes[key]
        size = tuple(target.shape)
        if len(offsets) != len(shape) or len(size) != len(shape):
            raise SnapshotError(f"{path}: {key} has {len(shape)} dims; asked for a region of {len(size)}")
        if any(o < 0 or o + s > d for o, s, d in zip(offsets, size, shape, strict=True)):
            raise SnapshotError(f"{path}: region {tuple(offsets)}+{size} lies outside {key} {shape}")
        if str(target.dtype).removeprefix("torch.") != dtype:
            raise SnapshotError(f"{path}: {key} is saved as {dtype}, the target is {target.dtype}")
    planner = _region_planner({key: tuple(offsets) for key, (offsets, _) in regions.items()})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(
                {key: target for key, (_, target) in regions.items()},
                storage_reader=safe_reader(path),
                planner=planner,
                no_dist=True,
            )
    except SnapshotError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP raises CheckpointException, a BaseException
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        raise SnapshotError(f"{path}: cannot read checkpoint tensors ({lines[-1]})") from None


def _region_planner(offsets: dict[str, tuple[int, ...]]) -> Any:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionLoadPlanner(DefaultLoadPlanner):
        """Reads, for each key, the region of the global tensor its target covers (DCP's own read items)."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> LoadPlan:
            items = []
            assert self.metadata is not None
            for key, target in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets[key]), sizes=target.size())
                stored = self.metadata.state_dict_metadata[key]
                assert isinstance(stored, TensorStorageMetadata)  # load_regions checked it is a tensor
                items += create_read_items_for_chunk_list(key, stored, [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.state_dict[index.fqn]

    return RegionLoadPlanner()


def check_megatron_storage(directory: str | Path) -> None:
    """SnapshotError unless every size `.metadata` declares is backed by the data files on disk."""
    oversized = check_checkpoint_storage(directory)
    if oversized:
        raise SnapshotError(oversized[0])
