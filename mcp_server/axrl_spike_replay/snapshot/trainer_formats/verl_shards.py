"""verl FSDP actor checkpoints: `model_world_size_{W}_rank_{r}.pt` + `fsdp_config.json`, merged into whole weights.

verl's `FSDPCheckpointManager.save_checkpoint` has every rank `torch.save` its sharded state dict
(FSDP2: DTensors whose local tensor is the rank's shard) and rank 0 write `fsdp_config.json`
(`{"FSDP_version": ..., "world_size": W}`). verl's own `model_merger` loads them with
`weights_only=False` and casts every shard to bf16; here each file is loaded with `weights_only=True`
(DTensor and the few classes its pickle names allow-listed for that load only) and the shards are
concatenated along their `Shard(dim)` in float32, never bf16, so no bit of an fp32 master weight is lost.
Plain tensors (buffers, unsharded parameters) must be identical on every rank and are kept once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.safe_load import load_pt
from axrl_spike_replay.untrusted.containment import file_inside
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, read_bounded
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json

if TYPE_CHECKING:
    import torch

FSDP_CONFIG = "fsdp_config.json"
MAX_FSDP_CONFIG_BYTES = 64 * 1024  # verl writes two keys
MAX_VERL_WORLD_SIZE = 1 << 16  # ranks of one actor checkpoint; far above any real run
_RANK_FILE = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def rank_file_name(world_size: int, rank: int) -> str:
    """verl's name for one rank's model shard."""
    return f"model_world_size_{world_size}_rank_{rank}.pt"


def is_verl_checkpoint(directory: str | Path) -> bool:
    """Whether `directory` looks like a verl FSDP actor checkpoint (it has verl's fsdp_config.json)."""
    return (Path(directory) / FSDP_CONFIG).is_file()


def dtensor_globals() -> list[Any]:
    """The classes a pickled FSDP2 DTensor names, for `weights_only` (those this torch has)."""
    import importlib

    wanted = (
        ("torch.distributed.tensor", "DTensor"),
        ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
        ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
        ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
        ("torch.distributed.tensor.placement_types", "Shard"),
        ("torch.distributed.tensor.placement_types", "Replicate"),
        ("torch.distributed.device_mesh", "DeviceMesh"),
        ("torch.distributed._mesh_layout", "_MeshLayout"),
        ("torch.distributed._mesh_layout", "_FlatLayout"),
    )
    found: list[Any] = []
    for module_name, name in wanted:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        value = getattr(module, name, None)
        if value is not None:
            found.append(value)
    return found


@dataclass(frozen=True)
class VerlCheckpoint:
    """A verl actor checkpoint directory's declared layout."""

    directory: Path
    world_size: int
    fsdp_version: int | None

    def rank_file(self, rank: int) -> Path:
        return self.directory / rank_file_name(self.world_size, rank)


def read_fsdp_config(directory: str | Path) -> VerlCheckpoint:
    """`fsdp_config.json`, validated, and the rank files it implies all present (SnapshotError otherwise)."""
    root = Path(directory)
    path = root / FSDP_CONFIG
    if not path.is_file():
        raise SnapshotError(f"{path}: not found (a verl FSDP checkpoint has fsdp_config.json beside its shards)")
    try:
        doc = parse_untrusted_json(read_bounded(file_inside(path), MAX_FSDP_CONFIG_BYTES), max_depth=4)
    except UntrustedInputError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(doc, dict):
        raise SnapshotError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    world_size = doc.get("world_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_VERL_WORLD_SIZE:
        raise SnapshotError(
            f"{path}: world_size must be an integer in [1, {MAX_VERL_WORLD_SIZE}], got {shown(world_size, 40)}"
        )
    version = doc.get("FSDP_version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise SnapshotError(f"{path}: FSDP_version must be an integer, got {shown(version, 40)}")
    checkpoint = VerlCheckpoint(root, world_size, version)
    others = sorted(
        name
        for name in (p.name for p in root.glob("model_world_size_*_rank_*.pt"))
        if (m := _RANK_FILE.fullmatch(name)) and int(m.group(1)) != world_size
    )
    if others:
        raise SnapshotError(
            f"{path}: world_size is {world_size} but the directory holds shards of another world size "
            f"({shown(others[:3], 200)})"
        )
    missing = [checkpoint.rank_file(r).name for r in range(world_size) if not checkpoint.rank_file(r).is_file()]
    if missing:
        raise SnapshotError(
            f"{root}: missing {len(missing)} of {world_size} rank files ({', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''})"
        )
    return checkpoint


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Floating tensors of 32 bits or fewer in float32 (exact: bf16/fp16 widen losslessly); others as they are."""
    import torch

    if tensor.is_floating_point() and tensor.dtype != torch.float64:
        return tensor.to(torch.float32)
    return tensor


def shard_placement(value: Any, file: Path, key: str) -> tuple[str, int]:
    """("shard", dim) or ("replicate", -1) of a 1-D-mesh DTensor (a leading replicated `ddp` dim is dropped)."""
    placements = tuple(getattr(value, "placements", ()))
    names = getattr(getattr(value, "device_mesh", None), "mesh_dim_names", None) or ()
    if len(placements) == 2 and names and names[0] in ("ddp", "dp") and placements[0].is_replicate():
        placements = placements[1:]  # HSDP: replicas of the same shards, as verl's merger treats them
    if len(placements) != 1:
        raise SnapshotError(
            f"{file}: {shown(key, 120)} is placed {shown(placements, 120)}; only FSDP's one-dimensional "
            "sharding (optionally under a replicated ddp dimension) can be merged"
        )
    placement = placements[0]
    if placement.is_shard():
        return "shard", int(placement.dim)
    if placement.is_replicate():
        return "replicate", -1
    raise SnapshotError(f"{file}: {shown(key, 120)} has placement {shown(placement, 60)}, which cannot be merged")


def load_rank_state(file: Path) -> dict[str, Any]:
    """One rank's FSDP state dict (name -> tensor or DTensor), loaded weights-only."""
    state = load_pt(file, allowed_globals=dtensor_globals())
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise SnapshotError(f"{file}: expected a state dict of name -> tensor, got {type(state).__name__}")
    return state


def load_verl_shards(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model state dict of a verl FSDP actor checkpoint, shards concatenated in float32.

    SnapshotError naming the file for: a missing rank file, a world size that disagrees with
    `fsdp_config.json` or with the DTensors' mesh, ranks holding different parameter names, shards
    whose placements or global shapes disagree, or merged shapes that differ from the declared ones.
    """
    import torch
    from torch.distributed.tensor import DTensor

    checkpoint = read_fsdp_config(directory)
    shards: dict[str, list[torch.Tensor]] = {}
    layout: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    names: list[str] | None = None
    for rank in range(checkpoint.world_size):
        file = checkpoint.rank_file(rank)
        state = load_rank_state(file)
        if names is None:
            names = list(state)
        elif set(state) != set(names):
            extra = sorted(set(state) - set(names))[:3]
            lacking = sorted(set(names) - set(state))[:3]
            raise SnapshotError(
                f"{file}: holds other parameters than rank 0 (extra {shown(extra, 160)}, missing {shown(lacking, 160)})"
            )
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise SnapshotError(f"{file}: {shown(key, 120)} is a {type(value).__name__}, not a tensor")
            if isinstance(value, DTensor):
                mesh_size = value.device_mesh.size(-1)
                if mesh_size != checkpoint.world_size and value.device_mesh.ndim == 1:
                    raise SnapshotError(
                        f"{file}: {shown(key, 120)} is sharded over {mesh_size} ranks but fsdp_config.json "
                        f"says world_size {checkpoint.world_size}"
                    )
                kind, dim = shard_placement(value, file, key)
                declared = (kind, dim, tuple(value.shape))
                if layout.setdefault(key, declared) != declared:
                    raise SnapshotError(
                        f"{file}: {shown(key, 120)} is {kind} dim {dim} of shape {tuple(value.shape)}, but rank 0 "
                        f"declared {layout[key][0]} dim {layout[key][1]} of shape {layout[key][2]}"
                    )
                local = value.to_local()
            else:
                if key in layout:
                    raise SnapshotError(f"{file}: {shown(key, 120)} is a plain tensor here but a DTensor on rank 0")
                local = value
            shards.setdefault(key, []).append(_fp32(local))
    merged: dict[str, torch.Tensor] = {}
    for key, parts in shards.items():
        if key not in layout:
            merged[key] = _replicated(key, parts, checkpoint)
            continue
        kind, dim, shape = layout[key]
        if kind == "replicate":
            merged[key] = _replicated(key, parts, checkpoint)
        else:
            if not all(p.dim() == len(shape) for p in parts) or not 0 <= dim < len(shape):
                raise SnapshotError(
                    f"{checkpoint.directory}: {shown(key, 120)} shards have shapes {[tuple(p.shape) for p in parts]}, "
                    f"not {len(shape)}-dimensional pieces of {shape} along dim {dim}"
                )
            merged[key] = torch.cat(parts, dim=dim).contiguous()
        if tuple(merged[key].shape) != shape:
            raise SnapshotError(
                f"{checkpoint.directory}: {shown(key, 120)} merges to shape {tuple(merged[key].shape)} from "
                f"{rank_file_name(checkpoint.world_size, 0)}..{checkpoint.world_size - 1}, but its DTensors "
                f"declare {shape}"
            )
    return merged


def _replicated(key: str, parts: list[torch.Tensor], checkpoint: VerlCheckpoint) -> torch.Tensor:
    """The one copy of an entry every rank holds whole; SnapshotError naming the rank file that differs."""
    import torch

    for rank, part in enumerate(parts[1:], start=1):
        if part.shape != parts[0].shape or not torch.equal(part, parts[0]):
            raise SnapshotError(
                f"{checkpoint.rank_file(rank)}: {shown(key, 120)} differs from rank 0's copy (shape "
                f"{tuple(part.shape)} vs {tuple(parts[0].shape)}); a replicated entry must be identical on every rank"
            )
    return parts[0].clone()
