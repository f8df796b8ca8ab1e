"""Per-rank snapshot files, loaded safely and validated: batch, grad info, routing payload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.fields import canonicalize_batch
from axrl_spike_replay.snapshot.layout import batch_file, grad_info_file, routing_payload_file
from axrl_spike_replay.snapshot.safe_load import load_pt

if TYPE_CHECKING:
    import torch


def load_rank_batch(snapshot_dir: str | Path, rank: int, *, meta: bool = False) -> dict[str, torch.Tensor]:
    """Rank `rank`'s batch under canonical field names (meta tensors when `meta`)."""
    path = Path(snapshot_dir) / batch_file(rank)
    return canonicalize_batch(load_pt(path, meta=meta), path)


def load_grad_info(snapshot_dir: str | Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s grad info: `grad_norm`, `param_grad_norms` {name: float}, optional extras."""
    path = Path(snapshot_dir) / grad_info_file(rank)
    doc = load_pt(path, mmap=False)
    if not isinstance(doc, dict):
        raise SnapshotError(f"{path}: expected a dict, got {type(doc).__name__}")
    if "grad_norm" not in doc:
        raise SnapshotError(f"{path}: missing key 'grad_norm'")
    norms = doc.get("param_grad_norms", {})
    if not isinstance(norms, dict):
        raise SnapshotError(f"{path}: 'param_grad_norms' must be a dict of name -> float")
    out = dict(doc)
    out["grad_norm"] = float(doc["grad_norm"])
    out["param_grad_norms"] = {str(k): float(v) for k, v in norms.items()}
    return out


@dataclass
class RoutingPayload:
    routed_experts: torch.Tensor  # int [B, T, L, K], -1 = no route
    moe_layers: list[int]
    source: str


def load_routing_payload(snapshot_dir: str | Path, rank: int, *, meta: bool = False) -> RoutingPayload:
    """Rank `rank`'s MoE routing payload, validated."""
    import torch

    path = Path(snapshot_dir) / routing_payload_file(rank)
    doc = load_pt(path, meta=meta)
    if not isinstance(doc, dict) or "routed_experts" not in doc:
        raise SnapshotError(f"{path}: expected a dict with 'routed_experts'")
    routes = doc["routed_experts"]
    if not isinstance(routes, torch.Tensor) or routes.dim() != 4 or routes.is_floating_point():
        shape = tuple(routes.shape) if isinstance(routes, torch.Tensor) else type(routes).__name__
        raise SnapshotError(f"{path}: 'routed_experts' must be an int tensor [B, T, L, K], got {shape}")
    layers = doc.get("moe_layers")
    layers = list(range(routes.shape[2])) if layers is None else [int(x) for x in layers]
    if len(layers) != routes.shape[2]:
        raise SnapshotError(f"{path}: 'moe_layers' lists {len(layers)} layers but routed_experts has {routes.shape[2]}")
    return RoutingPayload(routed_experts=routes, moe_layers=layers, source=str(doc.get("source", "rollout")))
