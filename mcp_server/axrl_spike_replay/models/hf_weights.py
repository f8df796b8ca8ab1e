"""Weights of an HF policy from what real runs write, in either expert layout, converted with transformers' own rules.

Sources: a DCP checkpoint (tensors under `model.`, as our capture and FSDP2 write them) or an HF directory
(`config.json` + `*.safetensors`, read with safetensors, never pickle). Expert weights may be fused
(`mlp.experts.gate_up_proj [E, 2I, H]`, transformers 5) or per expert (`mlp.experts.{e}.gate_proj.weight`,
transformers 4 / `save_pretrained` of older versions); the per-expert names are converted by the conversion
mapping transformers registers for the architecture (`conversion_mapping.py`), the same one `from_pretrained`
applies. Shapes are checked on meta tensors first, so a checkpoint that does not fit allocates nothing.
"""

from __future__ import annotations

import copy
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.dcp.checkpoint import (
    DCP_METADATA,
    check_checkpoint_storage,
    load_model_state,
    summarize_checkpoint,
)
from axrl_spike_replay.snapshot.safe_load import human_bytes

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axrl_spike_replay.models.hf_config import HFModelConfig


def weight_conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' (renamings, converters) for the model, as `from_pretrained` would apply them."""
    lm: Any = getattr(model, "causal_lm", model)  # an HFPolicy: the same names as its causal LM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    transforms = [t for t in get_model_conversion_mapping(lm, add_legacy=False) if not isinstance(t, PrefixChange)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def to_model_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under the model's own names and layout: per-expert tensors merged as `from_pretrained` merges them.

    Works on meta tensors too (shape checks without memory).
    """
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = weight_conversions(model)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, Any] = {}
    for key, tensor in sorted(state.items(), key=lambda kv: dot_natural_key(kv[0])):
        renamed, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            out[renamed] = tensor
            continue
        converter = pending.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
        converter.add_tensor(renamed, key, pattern, tensor)
    for name, converter in pending.items():
        try:
            lm = getattr(model, "causal_lm", model)
            converted = converter.convert(name, model=lm, config=getattr(lm, "config", None))
        except Exception as exc:  # transformers' ops raise plain errors on mismatched expert lists
            raise SnapshotError(f"cannot merge the per-expert tensors of {name} ({exc})") from None
        for target, value in converted.items():
            out[target] = value[0] if isinstance(value, list) else value
    return out


def to_per_expert_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reverse (transformers' `revert_weight_conversion`): what transformers 4 / `save_pretrained` store."""
    from transformers.core_model_loading import revert_weight_conversion

    lm: Any = getattr(model, "causal_lm", model)
    return revert_weight_conversion(lm, dict(state))


def _tied_names(model: nn.Module) -> set[str]:
    """State names whose tensor is another name's (tied embeddings): a checkpoint may omit them."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = id(tensor)
        if ptr in seen:
            tied.add(name)
        seen[ptr] = name
    return tied


def check_layout(model: nn.Module, saved: dict[str, torch.Tensor], label: str) -> list[str]:
    """Problems fitting `saved` (meta or real tensors, either layout) to the model's state: empty when it fits."""
    try:
        converted = to_model_layout(model, saved)
    except SnapshotError as exc:
        return [f"{label}: {exc}"]
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = _tied_names(model)
    missing = sorted(n for n in expected if n not in converted and n not in tied)
    wrong = sorted(
        f"{n} {tuple(converted[n].shape)} (model needs {shape})"
        for n, shape in expected.items()
        if n in converted and tuple(converted[n].shape) != shape
    )
    problems = ([f"missing {', '.join(missing[:5])}"] if missing else []) + wrong[:5]
    return [f"{label} does not fit the run config's model: {'; '.join(problems)}"] if problems else []


def _meta_model(spec: HFModelConfig) -> nn.Module:
    from axrl_spike_replay.models.hf_config import instantiate

    return instantiate(spec, "meta")


def dcp_model_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name under `model.`: (shape, dtype)} declared by a DCP checkpoint's metadata."""
    return {
        name.removeprefix("model."): value
        for name, value in summarize_checkpoint(directory).shapes.items()
        if name.startswith("model.")
    }


def _meta_tensors(shapes: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, torch.Tensor]:
    import torch

    return {n: torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for n, (shape, dtype) in shapes.items()}


MAX_SAFETENSORS_HEADER = 100 << 20
SAFETENSORS_DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2), "F64": ("float64", 8)}
SAFETENSORS_DTYPES["I64"] = ("int64", 8)
MAX_SAFETENSORS_DIMS = 16


def safetensors_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of an HF directory's `*.safetensors`, from their headers, read as untrusted input.

    Every header entry is checked before anything is built or mapped: a shape of non-negative integers whose
    bytes are exactly its `data_offsets` span, and spans that tile the file's data (no overlap, no hole), as the
    format requires. Anything else is a SnapshotError naming the file and the tensor.
    """
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in safetensors_files(directory):
        shapes.update(_file_shapes(path))
    return shapes


def _file_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from axrl_spike_replay.untrusted.untrusted_json import UntrustedJsonError, parse_untrusted_json

    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise SnapshotError(f"{path}: not a safetensors file (no header)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise SnapshotError(f"{path}: safetensors header of {length} bytes does not fit the file")
        try:
            header = parse_untrusted_json(handle.read(length), max_depth=4)
        except UntrustedJsonError as exc:
            raise SnapshotError(f"{path}: safetensors header {exc}") from None
    if not isinstance(header, dict):
        raise SnapshotError(f"{path}: safetensors header is not an object")
    data = size - 8 - length
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise SnapshotError(f"{path}: safetensors __metadata__ must map names to strings")
            continue
        shape, dtype, begin, end = _entry(path, name, info, data)
        shapes[name] = (shape, dtype)
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            where = "overlaps the tensor before it" if begin < at else f"leaves bytes {at}-{begin} of the data unused"
            raise SnapshotError(f"{path}: tensor {shown(name, 120)} at bytes {begin}-{end} {where}")
        at = end
    if at != data:
        raise SnapshotError(
            f"{path}: its tensors end at byte {at} of its {data} data bytes (a truncated or padded file)"
        )
    return shapes


def _entry(path: Path, name: str, info: Any, data: int) -> tuple[tuple[int, ...], str, int, int]:
    """(shape, dtype, begin, end) of one header entry, each checked."""
    if not isinstance(info, dict):
        raise SnapshotError(f"{path}: tensor {shown(name, 120)} has an unusable header entry")
    shape, dtype, offsets = info.get("shape"), info.get("dtype"), info.get("data_offsets")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_SAFETENSORS_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise SnapshotError(f"{path}: tensor {shown(name, 120)} has a bad shape {shown(shape, 80)}")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise SnapshotError(
            f"{path}: tensor {shown(name, 120)} has dtype {shown(dtype, 40)} (read: {', '.join(SAFETENSORS_DTYPES)})"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(x) is int for x in offsets):
        raise SnapshotError(f"{path}: tensor {shown(name, 120)} has bad data_offsets {shown(offsets, 80)}")
    begin, end = offsets
    if not 0 <= begin <= end <= data:
        raise SnapshotError(f"{path}: tensor {shown(name, 120)} lies outside the file")
    torch_dtype, itemsize = SAFETENSORS_DTYPES[dtype]
    numel = 1
    for d in shape:
        numel *= d
    if numel * itemsize != end - begin:
        raise SnapshotError(
            f"{path}: tensor {shown(name, 120)} declares shape {tuple(shape)} of {dtype} "
            f"({human_bytes(numel * itemsize)}) over {end - begin} bytes of data"
        )
    return tuple(shape), torch_dtype, begin, end


def safetensors_files(directory: Path) -> list[Path]:
    """The regular (not symlinked) `*.safetensors` files of an HF directory, sorted."""
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file() and not p.is_symlink())
    if not files:
        raise SnapshotError(f"{directory}: no *.safetensors weights (an HF directory holds config.json + safetensors)")
    return files


def weights_source(directory: Path) -> str:
    """ "dcp", "safetensors" or "verl_fsdp": which kind of weights `directory` holds."""
    from axrl_spike_replay.snapshot.trainer_formats.verl_shards import is_verl_checkpoint

    if (directory / DCP_METADATA).is_file():
        return "dcp"
    if any(directory.glob("*.safetensors")):
        return "safetensors"
    if is_verl_checkpoint(directory):
        return "verl_fsdp"
    raise SnapshotError(
        f"{directory}: neither a DCP checkpoint ({DCP_METADATA}), an HF directory (*.safetensors) nor a verl FSDP "
        "checkpoint (fsdp_config.json + model_world_size_W_rank_R.pt)"
    )


def check_hf_weights(directory: Path, spec: HFModelConfig, label: str) -> None:
    """SnapshotError unless the weights in `directory` fit the spec's model (checked on meta tensors)."""
    source = weights_source(directory)
    if source == "verl_fsdp":
        # the shard files' sizes are checked when they are read; the merged shapes are checked against the model
        # before any weight is copied (`load_hf_weights`): merging here would read every shard twice
        from axrl_spike_replay.snapshot.trainer_formats.verl_shards import read_fsdp_config

        read_fsdp_config(directory)
        return
    if source == "dcp":
        oversized = check_checkpoint_storage(directory)
        if oversized:
            raise SnapshotError(f"{label}: {oversized[0]}")
    shapes = dcp_model_shapes(directory) if source == "dcp" else safetensors_shapes(directory)
    problems = check_layout(_meta_model(spec), _meta_tensors(shapes), f"{directory}: {label}")
    if problems:
        raise SnapshotError(problems[0])


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint (under `model.`), an HF directory or a verl FSDP checkpoint, in the
    layout saved."""
    import torch

    source = weights_source(directory)
    if source == "verl_fsdp":
        from axrl_spike_replay.snapshot.trainer_formats.verl_shards import load_verl_shards

        return load_verl_shards(directory)  # merged along the shard dim in float32
    if source == "dcp":
        shapes = dcp_model_shapes(directory)
        state = {n: torch.empty(shape, dtype=getattr(torch, dtype)) for n, (shape, dtype) in shapes.items()}
        load_model_state(directory, state)
        return state
    from safetensors import SafetensorError, safe_open

    safetensors_shapes(directory)  # bounds every tensor by its file before safetensors maps it
    state = {}
    for path in safetensors_files(directory):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    state[name] = handle.get_tensor(name)
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # changed since its header was read
            raise SnapshotError(f"{path}: cannot read its tensors ({shown(str(exc), 200, quote=False)})") from None
    return state


def load_hf_weights(model: nn.Module, directory: Path) -> None:
    """Fill the policy's parameters and buffers from `directory`, converting the expert layout on the way."""
    import torch

    saved = read_weights(directory)
    problems = check_layout(model, saved, str(directory))
    if problems:
        raise SnapshotError(problems[0])
    converted = to_model_layout(model, saved)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name in converted:
                tensor.copy_(converted[name].to(tensor.dtype))
