"""Routing payloads as Megatron-core's router replay records them, read as the canonical [B, T, L, K] routes.

`RouterReplay` (megatron/core/transformer/moe/router_replay.py) keeps, per MoE layer of a pipeline stage, the
top-k expert ids of the layer's last forward: int64 [tokens, K], tokens in Megatron's sequence-major order
(hidden states are [S, B, H]: token s*B + b). The Megatron spike guard (integrations.megatron) saves each
data-parallel rank's lists, every stage's layers in pipeline order, as

    {"format": "megatron_router_replay", "topk_indices": [int64 [S*B, K], ...], "moe_layers": [global ids],
     "sequence_length": S, "micro_batch_size": B, "source": "train"}

An id of -1 means "no recorded route" (a token the payload leaves to the current router, as a rollout engine
marks padding). Every shape is checked before anything is read: one tensor per listed layer, all [S*B, K] with
the same K; a payload that does not fit its rank's batch is refused naming the file, the field and both shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError

if TYPE_CHECKING:
    import torch

MEGATRON_ROUTES_FORMAT = "megatron_router_replay"
MAX_TOPK = 1024


def is_megatron_payload(doc: Any) -> bool:
    """Whether a loaded routing payload is in Megatron's router-replay form."""
    return isinstance(doc, dict) and doc.get("format") == MEGATRON_ROUTES_FORMAT


def _size(doc: dict[str, Any], key: str, path: Path) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        raise SnapshotError(f"{path}: {key!r} must be a positive integer, got {shown(value, 60)}")
    return value


def megatron_routes(doc: dict[str, Any], path: Path, layers: list[int]) -> torch.Tensor:
    """The payload's per-layer [S*B, K] top-k ids as routes [B, S, L, K] (works on meta tensors)."""
    import torch

    tensors = doc.get("topk_indices")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise SnapshotError(f"{path}: 'topk_indices' must be a non-empty list of int64 [tokens, top_k] tensors")
    if len(tensors) != len(layers):
        raise SnapshotError(f"{path}: 'moe_layers' lists {len(layers)} layers but 'topk_indices' holds {len(tensors)}")
    seq, micro = _size(doc, "sequence_length", path), _size(doc, "micro_batch_size", path)
    top_k = None
    for i, t in enumerate(tensors):
        if (
            not isinstance(t, torch.Tensor)
            or t.dim() != 2
            or t.is_floating_point()
            or t.is_complex()
            or t.dtype == torch.bool
        ):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise SnapshotError(
                f"{path}: topk_indices[{i}] (layer {layers[i]}) must be an int [tokens, top_k] tensor, got {got}"
            )
        top_k = t.shape[1] if top_k is None else top_k
        if t.shape != (seq * micro, top_k) or not 0 < top_k <= MAX_TOPK:
            raise SnapshotError(
                f"{path}: topk_indices[{i}] (layer {layers[i]}) has shape {tuple(t.shape)}; the payload says "
                f"{seq} positions x {micro} samples = {seq * micro} tokens, top-k {top_k}"
            )
    stacked = torch.stack([t.reshape(seq, micro, -1).transpose(0, 1) for t in tensors], dim=2)
    return stacked.long() if stacked.device.type != "meta" else stacked.to(torch.long)


def check_fits_batch(routes: torch.Tensor, tokens: torch.Tensor, path: Path) -> None:
    """SnapshotError unless the routes cover the batch token for token ([B, T] of the tokens)."""
    if tuple(routes.shape[:2]) != tuple(tokens.shape):
        raise SnapshotError(
            f"{path}: the routing payload covers {routes.shape[0]} samples x {routes.shape[1]} positions "
            f"(routes {tuple(routes.shape)}) but the rank's batch has tokens {tuple(tokens.shape)}: it is not this "
            "batch's routing (a payload of another micro-batch or another rank)"
        )


def megatron_payload(routes: list[torch.Tensor], layers: list[int], micro: int, seq: int) -> dict[str, Any]:
    """The payload document for per-layer [S*B, K] top-k ids recorded by Megatron's router replay."""
    return {
        "format": MEGATRON_ROUTES_FORMAT,
        "topk_indices": [t.detach().to("cpu", dtype=routes[0].dtype) for t in routes],
        "moe_layers": list(layers),
        "sequence_length": seq,
        "micro_batch_size": micro,
        "source": "train",
    }


def to_router_replay(routes: torch.Tensor) -> list[torch.Tensor]:
    """Canonical routes [B, S, L, K] as the per-layer int64 [S*B, K] lists `RouterReplay.set_replay_data` takes."""
    return [
        routes[:, :, layer, :].transpose(0, 1).reshape(-1, routes.shape[-1]).long() for layer in range(routes.shape[2])
    ]
