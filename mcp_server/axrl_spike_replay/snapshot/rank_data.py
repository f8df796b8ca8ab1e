"""Per-rank snapshot files, loaded safely and validated: batch, grad info, routing payload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.fields import canonicalize_batch
from axrl_spike_replay.snapshot.layout import batch_file, grad_info_file, routing_payload_file
from axrl_spike_replay.snapshot.safe_load import load_pt
from axrl_spike_replay.snapshot.trainer_formats.megatron_routes import (
    MEGATRON_ROUTES_FORMAT,
    check_fits_batch,
    is_megatron_payload,
    megatron_routes,
)
from axrl_spike_replay.snapshot.trainer_formats.verl_batch import VERL_COUNT_KEYS, is_verl_jagged_batch, verl_routes

if TYPE_CHECKING:
    import torch


def load_rank_batch(snapshot_dir: str | Path, rank: int, *, meta: bool = False) -> dict[str, torch.Tensor]:
    """Rank `rank`'s batch under canonical field names (meta tensors when `meta`)."""
    path = Path(snapshot_dir) / batch_file(rank)
    raw = load_pt(path, meta=meta)
    if meta and isinstance(raw, dict) and is_verl_jagged_batch(raw):
        raw = load_pt(path)  # jagged lengths live in the offsets' data: map the file (only the offsets are read)
    return canonicalize_batch(raw, path)


def load_batch_counts(snapshot_dir: str | Path, rank: int) -> dict[str, float] | None:
    """The step's global counts rank `rank`'s batch carries under verl's names (`dp_size`, `batch_num_tokens`,
    `global_batch_size`: set by verl's engine on the mini-batch, saved by the verl hook), or None unless it holds
    all three. Only the batch's scalars are read (the file is mapped)."""
    path = Path(snapshot_dir) / batch_file(rank)
    raw = load_pt(path)
    if not isinstance(raw, dict) or not all(key in raw for key in VERL_COUNT_KEYS):
        return None
    return {key: _real(raw[key], path, key) for key in VERL_COUNT_KEYS}


def _real(value: Any, path: Path, key: str) -> float:
    """A real number saved as a Python number or a one-element tensor; SnapshotError naming `key` otherwise."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise SnapshotError(f"{path}: {key} must be a number, got a tensor of shape {tuple(value.shape)}")
        return float(value.reshape(()).item())  # one element: reads a few bytes of the mapping
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SnapshotError(f"{path}: {key} must be a number, got {type(value).__name__} {shown(value, 60)}")
    try:
        return float(value)
    except OverflowError:
        raise SnapshotError(f"{path}: {key} is an integer too large for a float ({shown(value, 60)})") from None


def _grad_doc(snapshot_dir: str | Path, rank: int) -> tuple[Path, dict[Any, Any]]:
    path = Path(snapshot_dir) / grad_info_file(rank)
    doc = load_pt(path)
    if not isinstance(doc, dict):
        raise SnapshotError(f"{path}: expected a dict, got {type(doc).__name__}")
    if "grad_norm" not in doc:
        raise SnapshotError(f"{path}: missing key 'grad_norm'")
    return path, doc


def load_grad_norm(snapshot_dir: str | Path, rank: int) -> float:
    """Rank `rank`'s recorded global grad norm, reading nothing else of the file's tensors."""
    path, doc = _grad_doc(snapshot_dir, rank)
    return _real(doc["grad_norm"], path, "grad_norm")


def load_grad_info(snapshot_dir: str | Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s grad info: `grad_norm`, `param_grad_norms` {name: float}, `param_numel` {name: int}, extras.

    Every value used is type-checked; `loss` and `num_tokens` are None unless they are numbers.
    """
    path, doc = _grad_doc(snapshot_dir, rank)
    norms = doc.get("param_grad_norms", {})
    if not isinstance(norms, dict):
        raise SnapshotError(f"{path}: 'param_grad_norms' must be a dict of name -> float")
    numel = doc.get("param_numel") or {}
    if not isinstance(numel, dict):
        raise SnapshotError(f"{path}: 'param_numel' must be a dict of name -> int")
    out = dict(doc)
    out["grad_norm"] = _real(doc["grad_norm"], path, "grad_norm")
    out["param_grad_norms"] = {  # a float is taken as is; anything else is checked and named (label built then)
        _name(k, path): v if type(v) is float else _real(v, path, f"param_grad_norms[{shown(str(k), 80)}]")
        for k, v in norms.items()
    }
    out["param_numel"] = {_name(k, path): _count(v, path, k) for k, v in numel.items()}
    for key in ("loss", "num_tokens"):
        try:
            out[key] = _real(doc[key], path, key) if doc.get(key) is not None else None
        except SnapshotError:
            out[key] = None  # optional extras: shown as unknown rather than failing the verb
    return out


def recorded_rank_loss(snapshot_dir: str | Path, rank: int) -> float | None:
    """Rank `rank`'s recorded loss (grad info `loss`); None when it was not recorded or cannot be read."""
    try:
        return load_grad_info(snapshot_dir, rank)["loss"]
    except SnapshotError:
        return None


def _name(key: Any, path: Path) -> str:
    if not isinstance(key, str):
        raise SnapshotError(f"{path}: parameter names must be strings, got {type(key).__name__} {shown(key, 60)}")
    return key


_EXACT_COUNT = 2**53  # counts up to here go through a float and back unchanged


def _count(value: Any, path: Path, key: Any) -> int:
    if type(value) is int and 0 <= value <= _EXACT_COUNT:
        return value  # what the float round trip below gives, without building the label
    number = _real(value, path, f"param_numel[{shown(str(key), 80)}]")
    if not number.is_integer() or number < 0:
        raise SnapshotError(f"{path}: param_numel[{shown(str(key), 80)}] must be a count, got {number}")
    return int(number)


@dataclass
class RoutingPayload:
    routed_experts: torch.Tensor  # int [B, T, L, K], -1 = no route
    moe_layers: list[int]
    source: str
    format: str = "axrl"  # or MEGATRON_ROUTES_FORMAT: Megatron's router-replay lists, read as routes [B, T, L, K]
    file: Path | None = None  # the file the routes were read from (a routing payload, or a verl batch)
    layers_listed: bool = True  # False: the file names no layers (`moe_layers` is then 0..L-1, the slots in order)


MAX_LAYER_ID = 1 << 16  # a global layer id; real models have at most a few hundred layers


def load_routing_payload(snapshot_dir: str | Path, rank: int, *, meta: bool = False) -> RoutingPayload:
    """Rank `rank`'s MoE routing payload, validated (types of every field, layer ids, shapes)."""
    import torch

    path = Path(snapshot_dir) / routing_payload_file(rank)
    doc = load_pt(path, meta=meta)
    megatron = is_megatron_payload(doc)  # Megatron's router-replay lists (snapshot.trainer_formats.megatron_routes)
    if not megatron and (not isinstance(doc, dict) or "routed_experts" not in doc):
        raise SnapshotError(f"{path}: expected a dict with 'routed_experts'")
    routes = megatron_routes(doc, path, _layers(doc, path, None)) if megatron else doc["routed_experts"]
    if (
        not isinstance(routes, torch.Tensor)
        or routes.dim() != 4
        or routes.is_floating_point()
        or routes.is_complex()
        or routes.dtype == torch.bool
    ):
        shape = tuple(routes.shape) if isinstance(routes, torch.Tensor) else type(routes).__name__
        raise SnapshotError(f"{path}: 'routed_experts' must be an int tensor [B, T, L, K], got {shape}")
    listed = doc.get("moe_layers") is not None
    layers = _layers(doc, path, routes.shape[2])
    if len(layers) != routes.shape[2]:
        raise SnapshotError(f"{path}: 'moe_layers' lists {len(layers)} layers but routed_experts has {routes.shape[2]}")
    if len(set(layers)) != len(layers):
        raise SnapshotError(f"{path}: 'moe_layers' repeats a layer id ({shown(layers, 80)})")
    source = doc.get("source", "rollout")
    if not isinstance(source, str) or len(source) > 64:
        raise SnapshotError(f"{path}: 'source' must be a short string ('rollout' or 'train'), got {shown(source, 60)}")
    return RoutingPayload(
        routed_experts=routes,
        moe_layers=layers,
        source=source,
        format=MEGATRON_ROUTES_FORMAT if megatron else "axrl",
        file=path,
        layers_listed=listed,
    )


def _layers(doc: dict[str, Any], path: Path, default: int | None) -> list[int]:
    """The payload's `moe_layers` (global layer ids), checked; `range(default)` when absent and a default is given."""
    layers = doc.get("moe_layers")
    if layers is None and default is not None:
        return list(range(default))
    if isinstance(layers, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_LAYER_ID for x in layers
    ):
        return list(layers)
    raise SnapshotError(
        f"{path}: 'moe_layers' must be a list of layer ids in [0, {MAX_LAYER_ID}), got {shown(layers, 80)}"
    )


def load_rank_routes(
    snapshot_dir: str | Path, rank: int, *, meta: bool = False, batch: dict[str, Any] | None = None
) -> RoutingPayload | None:
    """Rank `rank`'s recorded routes: its routing payload file, else the `routed_experts` its batch carries
    (verl's mini-batch, [batch, seq, layers, top_k] with -1 on padding, its layers in order), else None.

    `batch`: the rank's canonical batch when the caller has it loaded (read from the file otherwise)."""
    if (Path(snapshot_dir) / routing_payload_file(rank)).is_file():
        payload = load_routing_payload(snapshot_dir, rank, meta=meta)
        if payload.format == MEGATRON_ROUTES_FORMAT and batch is not None and "tokens" in batch:
            check_fits_batch(payload.routed_experts, batch["tokens"], Path(snapshot_dir) / routing_payload_file(rank))
        return payload
    if batch is None:
        batch = load_rank_batch(snapshot_dir, rank, meta=meta)
    routes = verl_routes(batch)
    if routes is None:
        return None
    tokens = batch["tokens"]
    if tuple(routes.shape[:2]) != tuple(tokens.shape):
        raise SnapshotError(
            f"{Path(snapshot_dir) / batch_file(rank)}: 'routed_experts' has shape {tuple(routes.shape)}, "
            f"expected [{tokens.shape[0]}, {tokens.shape[1]}, layers, top_k] like the tokens"
        )
    return RoutingPayload(
        routed_experts=routes,
        moe_layers=list(range(routes.shape[2])),
        source="rollout",
        file=Path(snapshot_dir) / batch_file(rank),
        layers_listed=False,
    )
