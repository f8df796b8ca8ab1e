"""Row ranges of a verl FSDP actor checkpoint's tensors, read from the memory-mapped rank shards that hold them.

`verl_shards.load_verl_shards` merges every shard into whole float32 tensors; a sharded replay wants only the rows
of its own shards. `VerlSlices` opens each `model_world_size_{W}_rank_{r}.pt` memory-mapped (`weights_only=True`,
DTensor allow-listed for that load), checks what the merge checks (the same names on every rank, one placement
and global shape per tensor, pieces that add up to it) without reading any tensor data, then copies into each
target only the overlap of the saved pieces with the rows asked for: a `Shard(0)` tensor touches the rank files
whose rows overlap, a `Shard(d)` one the asked rows of every piece. Replicated entries are read from rank 0 and
compared with every other rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.trainer_formats.verl_shards import load_rank_state, read_fsdp_config, shard_placement

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _Layout:
    kind: str  # "shard" | "replicate" (a plain tensor is replicated)
    dim: int
    shape: tuple[int, ...]
    starts: tuple[int, ...]  # each rank piece's first index along `dim` (shards)


class VerlSlices:
    """A verl FSDP checkpoint as a sliced weight source (`models.sharded_weights.WeightSource`)."""

    def __init__(self, directory: str | Path) -> None:
        from torch.distributed.tensor import DTensor

        self.checkpoint = read_fsdp_config(directory)
        self.locals: list[dict[str, torch.Tensor]] = []
        layouts: dict[str, tuple[str, int, tuple[int, ...]]] = {}
        names: set[str] | None = None
        for rank in range(self.checkpoint.world_size):
            file = self.checkpoint.rank_file(rank)
            state = load_rank_state(file)
            if names is None:
                names = set(state)
            elif set(state) != names:
                extra, lacking = sorted(set(state) - names)[:3], sorted(names - set(state))[:3]
                raise SnapshotError(
                    f"{file}: holds other parameters than rank 0 (extra {shown(extra, 160)}, "
                    f"missing {shown(lacking, 160)})"
                )
            local: dict[str, torch.Tensor] = {}
            for key, value in state.items():
                if not isinstance(value, _tensor_type()):
                    raise SnapshotError(f"{file}: {shown(key, 120)} is a {type(value).__name__}, not a tensor")
                if isinstance(value, DTensor):
                    kind, dim = shard_placement(value, file, key)
                    declared = (kind, dim, tuple(value.shape))
                    if layouts.setdefault(key, declared) != declared:
                        raise SnapshotError(
                            f"{file}: {shown(key, 120)} is {kind} dim {dim} of shape {tuple(value.shape)}, but rank 0 "
                            f"declared {layouts[key][0]} dim {layouts[key][1]} of shape {layouts[key][2]}"
                        )
                    local[key] = value.to_local()
                else:
                    if key in layouts:
                        raise SnapshotError(f"{file}: {shown(key, 120)} is a plain tensor here but a DTensor on rank 0")
                    local[key] = value
            self.locals.append(local)
        self.layouts = {key: self._layout(key, layouts.get(key)) for key in (names or set())}
        self.shapes = {key: (lay.shape, _dtype(self.locals[0][key])) for key, lay in self.layouts.items()}

    def _layout(self, key: str, declared: tuple[str, int, tuple[int, ...]] | None) -> _Layout:
        pieces = [local[key] for local in self.locals]
        if declared is None or declared[0] == "replicate":
            shape = tuple(pieces[0].shape)
            return _Layout("replicate", -1, tuple(declared[2]) if declared else shape, ())
        _, dim, shape = declared
        starts, at = [], 0
        for rank, piece in enumerate(pieces):
            if piece.dim() != len(shape) or not 0 <= dim < len(shape):
                raise SnapshotError(
                    f"{self.checkpoint.rank_file(rank)}: {shown(key, 120)} piece {tuple(piece.shape)} is not a "
                    f"{len(shape)}-dimensional piece of {shape} along dim {dim}"
                )
            rest = tuple(piece.shape[:dim]) + tuple(piece.shape[dim + 1 :])
            if rest != shape[:dim] + shape[dim + 1 :]:
                raise SnapshotError(
                    f"{self.checkpoint.rank_file(rank)}: {shown(key, 120)} piece {tuple(piece.shape)} does not fit "
                    f"{shape} sharded along dim {dim}"
                )
            starts.append(at)
            at += int(piece.shape[dim])
        if at != shape[dim]:
            raise SnapshotError(
                f"{self.checkpoint.directory}: {shown(key, 120)} pieces add up to {at} along dim {dim}, but its "
                f"DTensors declare {shape}"
            )
        return _Layout("shard", dim, tuple(shape), tuple(starts))

    def read(self, regions: dict[str, tuple[int, torch.Tensor]]) -> None:
        """Fill each target with rows [row, row + len(target)) of the saved tensor (other dims whole)."""
        import torch

        for key, (row, target) in regions.items():
            lay = self.layouts[key]
            pieces = [local[key] for local in self.locals]
            if target.dim() == 0:
                target.copy_(pieces[0])
                continue
            end = row + target.shape[0]
            if lay.kind == "replicate":
                target.copy_(pieces[0][row:end])
                for rank, piece in enumerate(pieces[1:], start=1):
                    if piece.shape != pieces[0].shape or not torch.equal(piece[row:end], pieces[0][row:end]):
                        raise SnapshotError(
                            f"{self.checkpoint.rank_file(rank)}: {shown(key, 120)} differs from rank 0's copy; a "
                            "replicated entry must be identical on every rank"
                        )
                continue
            for start, piece in zip(lay.starts, pieces, strict=True):
                length = int(piece.shape[lay.dim])
                if lay.dim == 0:
                    low, high = max(row, start), min(end, start + length)
                    if low < high:
                        target[low - row : high - row].copy_(piece[low - start : high - start])
                else:
                    target.narrow(lay.dim, start, length).copy_(piece[row:end])


def _tensor_type() -> Any:
    import torch

    return torch.Tensor


def _dtype(tensor: torch.Tensor) -> str:
    """The dtype rows are read in: float32 for floating tensors of 32 bits or fewer (as the merge keeps them)."""
    import torch

    if tensor.is_floating_point() and tensor.dtype != torch.float64:
        return "float32"
    return str(tensor.dtype).removeprefix("torch.")
