"""Weights straight into a sharded policy: each process reads only the rows of its own shards.

After `fully_shard` each parameter is a DTensor placed `Shard(0)` over the replay's processes; its local tensor
is rows [offset, offset + n) of the whole. Those rows are read from where the weights are, and nothing else:

- a DCP checkpoint (our capture, FSDP2's `get_model_state_dict`): DCP reads the chunks that overlap the rows
  (`snapshot.trainer_formats.megatron_checkpoint.load_regions`), whatever layout saved them (it reshards on load);
- an HF directory: `safe_open(...).get_slice(name)[a:b]` per tensor;
- a verl FSDP checkpoint: the rows of each memory-mapped rank shard that overlap ours
  (`snapshot.trainer_formats.verl_slices`).
- a Megatron `torch_dist` checkpoint: route 1's mapping onto the transformers names (`models.mcore.megatron_source`),
  each key's rows of one layer, a fused QKV or gate/up read whole for the layer and split.

Checkpoints in the per-expert layout (transformers 4 / older `save_pretrained`) are converted by transformers' own
mapping (`hf_weights.to_model_layout`) on the experts a shard holds, one parameter at a time. Buffers FSDP does not
shard (a router's correction bias) are read whole. Reads go one FSDP unit (decoder layer) at a time into buffers
of the saved dtype, so loading holds the shards plus one layer's rows, never a whole model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError

if TYPE_CHECKING:
    import torch
    from torch import nn

Regions = dict[str, tuple[int, "torch.Tensor"]]  # {saved name: (first row, target whose rows are read)}


class WeightSource(Protocol):
    """Saved tensors by name ({name: (shape, dtype)}) and a reader of row ranges into given tensors."""

    shapes: dict[str, tuple[tuple[int, ...], str]]

    def read(self, regions: Regions) -> None:
        """Fill each target with rows [offset, offset + len(target)) of the saved tensor (other dims whole)."""
        ...


def local_rows(tensor: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first row, local tensor) of an FSDP2 parameter (a DTensor sharded on dim 0); a plain tensor is all rows."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return 0, tensor.data
    local = tensor.to_local()
    if local.numel() == 0:
        return 0, local
    chunks = tensor.__create_chunk_list__()  # DCP's view of this rank's piece: its offsets in the whole tensor
    if len(chunks) != 1 or any(chunks[0].offsets[1:]):
        raise SnapshotError(f"a sharded parameter is not placed in row blocks ({tensor.placements})")
    return int(chunks[0].offsets[0]), local


class DcpSource:
    """The model tensors (under `model.`) of a DCP checkpoint; rows read by DCP, only the overlapping chunks."""

    def __init__(self, directory: Path, prefix: str = "model.") -> None:
        from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage, summarize_checkpoint

        oversized = check_checkpoint_storage(directory)
        if oversized:
            raise SnapshotError(oversized[0])
        self.directory, self.prefix = directory, prefix
        self.shapes = {
            name.removeprefix(prefix): value
            for name, value in summarize_checkpoint(directory).shapes.items()
            if name.startswith(prefix)
        }

    def read(self, regions: Regions) -> None:
        from axrl_spike_replay.snapshot.trainer_formats.megatron_checkpoint import load_regions

        if regions:
            load_regions(
                self.directory,
                {f"{self.prefix}{n}": (_offsets(row, t), t) for n, (row, t) in regions.items()},
            )


def _offsets(row: int, target: torch.Tensor) -> tuple[int, ...]:
    return (row,) + (0,) * (target.dim() - 1) if target.dim() else ()


class SafetensorsSource:
    """An HF directory's `*.safetensors`, bounded by their headers first; rows read with `get_slice`."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        from axrl_spike_replay.models.hf_weights import safetensors_files, safetensors_shapes

        self.shapes = safetensors_shapes(directory)  # every tensor checked to lie inside its file
        self.files: dict[str, str] = {}
        for path in safetensors_files(directory):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self.files[name] = str(path)

    def read(self, regions: Regions) -> None:
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in regions:
            by_file.setdefault(self.files[name], []).append(name)
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as handle:
                for name in names:
                    row, target = regions[name]
                    part = handle.get_slice(name)
                    target.copy_(part[row : row + target.shape[0]] if target.dim() else part[:])


def open_source(directory: Path) -> WeightSource:
    """The weights in `directory` as a sliced source: a DCP checkpoint, an HF directory or verl FSDP shards."""
    from axrl_spike_replay.models.hf_weights import weights_source

    kind = weights_source(directory)
    if kind == "verl_fsdp":
        from axrl_spike_replay.snapshot.trainer_formats.verl_slices import VerlSlices

        return VerlSlices(directory)
    if kind == "safetensors":
        return SafetensorsSource(directory)
    return DcpSource(directory)


@dataclass
class _Converted:
    """A model tensor made by transformers' conversion from several saved ones (per-expert lists)."""

    by_pattern: dict[str, list[str]] = field(default_factory=dict)  # pattern -> saved names, in expert order


def conversion_plan(
    model: nn.Module, shapes: Mapping[str, Any], targets: Iterable[str]
) -> tuple[dict[str, str], dict[str, _Converted]]:
    """({model name: saved name} read as is, {model name: its per-expert sources}) for the model's tensors."""
    wanted = set(targets)
    direct: dict[str, str] = {}
    converted: dict[str, _Converted] = {}
    rename: Callable[[str], tuple[str, str | None]] = _renamer(model)
    from transformers.core_model_loading import dot_natural_key

    for key in sorted(shapes, key=dot_natural_key):
        target, pattern = rename(key)
        if target not in wanted:
            continue
        if pattern is None:
            direct[target] = key
        else:
            converted.setdefault(target, _Converted()).by_pattern.setdefault(pattern, []).append(key)
    return direct, converted


def _renamer(model: nn.Module) -> Callable[[str], tuple[str, str | None]]:
    """transformers' renaming of a saved key onto the model (identity for a model with no HF conversions)."""
    if not hasattr(model, "causal_lm"):
        return lambda key: (key, None)
    from transformers.core_model_loading import rename_source_key

    from axrl_spike_replay.models.hf_weights import weight_conversions

    renamings, converters = weight_conversions(model)
    return lambda key: rename_source_key(key, renamings, converters)


def _buffer(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype))


def _unit_order(names: Iterable[str]) -> list[list[str]]:
    """Names grouped by decoder layer (`.layers.<i>.` / `blocks.<i>.`), the rest last: one read per group."""
    groups: dict[int, list[str]] = {}
    for name in names:
        match = re.search(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.", name)
        groups.setdefault(int(match.group(1)) if match else 1 << 30, []).append(name)
    return [groups[k] for k in sorted(groups)]


def load_sharded(
    model: nn.Module,
    source: WeightSource,
    label: str,
    only: Iterable[str] | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Fill a sharded (or plain) model's parameters and persistent buffers with the rows each holds, from `source`
    (`only`: those of these state names, a streamed replay's one layer; `state`: the tensors to fill by name,
    given instead of the model's whole state dict, as a read on another thread gives them).

    SnapshotError naming the tensor when the saved layout does not fit the model (checked on global shapes before
    any row is read)."""
    import torch

    state = dict(state) if state is not None else model.state_dict(keep_vars=True)
    if only is not None:
        wanted = set(only)
        state = {name: tensor for name, tensor in state.items() if name in wanted}
    direct, converted = conversion_plan(model, source.shapes, state)
    tied = _tied(state)
    missing = sorted(n for n in state if n not in direct and n not in converted and n not in tied)
    if missing:
        raise SnapshotError(f"{label}: lacks {len(missing)} model tensors ({shown(missing[:5], 200)})")
    for name, saved in direct.items():
        shape = tuple(source.shapes[saved][0])
        if shape != tuple(state[name].shape):
            raise SnapshotError(f"{label}: {saved} is {shape}, the model's {name} is {tuple(state[name].shape)}")
    with torch.no_grad():
        for group in _unit_order(n for n in state if n in direct):
            regions: Regions = {}
            targets: dict[str, torch.Tensor] = {}
            for name in group:
                row, local = local_rows(state[name])
                if local.numel() == 0:
                    continue
                saved = direct[name]
                regions[saved] = (row, _buffer(tuple(local.shape), source.shapes[saved][1]))
                targets[saved] = local
            source.read(regions)
            for saved, (_, buffer) in regions.items():
                targets[saved].copy_(buffer)
        for name, plan in converted.items():
            _load_converted(model, source, name, state[name], plan, label)


def _tied(state: Mapping[str, torch.Tensor]) -> set[str]:
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            tied.add(name)
        seen[id(tensor)] = name
    return tied


def _load_converted(
    model: nn.Module, source: WeightSource, name: str, param: torch.Tensor, plan: _Converted, label: str
) -> None:
    """One per-expert-layout parameter: the saved experts of this shard's rows, converted by transformers' mapping."""
    from axrl_spike_replay.models.hf_weights import to_model_layout

    row, local = local_rows(param)
    if local.numel() == 0:
        return
    experts = {len(keys) for keys in plan.by_pattern.values()}
    if experts != {int(param.shape[0])}:
        raise SnapshotError(
            f"{label}: {name} {tuple(param.shape)} is made of {sorted(experts)} saved tensors per source pattern; "
            "its rows must be one saved tensor each (experts)"
        )
    keys = [k for keys in plan.by_pattern.values() for k in keys[row : row + local.shape[0]]]
    regions: Regions = {k: (0, _buffer(tuple(source.shapes[k][0]), source.shapes[k][1])) for k in keys}
    source.read(regions)
    out = to_model_layout(model, {k: t for k, (_, t) in regions.items()})
    value = out.get(name)
    if value is None or tuple(value.shape) != tuple(local.shape):
        got = None if value is None else tuple(value.shape)
        raise SnapshotError(f"{label}: converting the saved experts of {name} gave {got}, not {tuple(local.shape)}")
    local.copy_(value)
