"""MoE routing metadata of a snapshot: routed tokens and expert load per layer, per rank and merged."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.layout import rank_files, routing_payload_file
from axrl_spike_replay.snapshot.rank_data import load_routing_payload

if TYPE_CHECKING:
    import torch

MAX_EXPERTS = 1 << 16  # expert ids index a per-expert count; real MoE layers have at most a few thousand experts


def routing_signals(snapshot_dir: str | Path, loss_masks: dict[int, torch.Tensor]) -> dict[str, Any]:
    """Routing summary from every rank's routing payload; `loss_masks` {rank: bool [B, T]} for loss-token counts.

    Returns `available`, `ranks_without_payload`, `sources`, `moe_layers`, `per_rank` [{rank, source,
    routed_tokens, routed_loss_tokens}], `expert_load` {layer: [tokens per expert]} and
    `load_imbalance` {layer: max / mean expert load} (1.0 is perfectly balanced).
    """
    import torch

    directory = Path(snapshot_dir)
    files = rank_files(directory)["routing_payload"]
    ranks = sorted(loss_masks)
    doc: dict[str, Any] = {"available": bool(files), "ranks_without_payload": [r for r in ranks if r not in files]}
    if not files:
        return doc
    per_rank: list[dict[str, Any]] = []
    loads: dict[int, torch.Tensor] = {}
    sources: set[str] = set()
    layers: list[int] = []
    for rank in sorted(files):
        payload = load_routing_payload(directory, rank)
        routes = payload.routed_experts.long()
        routed = routes >= 0
        if routes.numel() and int(routes.max()) >= MAX_EXPERTS:
            raise SnapshotError(
                f"{directory / routing_payload_file(rank)}: expert id {int(routes.max())} in routed_experts is beyond "
                f"the {MAX_EXPERTS}-expert limit"
            )
        per_token = routed.any(dim=-1)  # [B, T, L]
        entry: dict[str, Any] = {
            "rank": rank,
            "source": payload.source,
            "routed_tokens": dict(zip(payload.moe_layers, per_token.sum(dim=(0, 1)).tolist(), strict=True)),
            "routed_loss_tokens": None,
        }
        mask = loss_masks.get(rank)
        if mask is not None and tuple(mask.shape) == tuple(routes.shape[:2]):
            in_loss = (per_token & mask[..., None]).sum(dim=(0, 1)).tolist()
            entry["routed_loss_tokens"] = dict(zip(payload.moe_layers, in_loss, strict=True))
        elif mask is not None:
            entry["problem"] = (
                f"routed_experts covers {tuple(routes.shape[:2])} (samples, tokens) but the batch is "
                f"{tuple(mask.shape)}; loss-token counts skipped"
            )
        for i, layer in enumerate(payload.moe_layers):
            ids = routes[:, :, i, :][routed[:, :, i, :]]
            counts = torch.bincount(ids, minlength=1)
            previous = loads.get(layer, torch.zeros(0, dtype=torch.long))
            width = max(previous.numel(), counts.numel())
            loads[layer] = _pad(previous, width) + _pad(counts, width)
        per_rank.append(entry)
        sources.add(payload.source)
        layers += [layer for layer in payload.moe_layers if layer not in layers]
    n_experts = max((load.numel() for load in loads.values()), default=0)
    expert_load = {layer: _pad(loads[layer], n_experts).tolist() for layer in sorted(loads)}
    imbalance = {
        layer: (max(counts) / (sum(counts) / len(counts)) if sum(counts) else None)
        for layer, counts in expert_load.items()
    }
    doc.update(
        sources=sorted(sources),
        moe_layers=sorted(layers),
        num_experts_seen=n_experts,
        per_rank=per_rank,
        expert_load=expert_load,
        load_imbalance=imbalance,
    )
    return doc


def _pad(values: torch.Tensor, width: int) -> torch.Tensor:
    import torch

    if values.numel() >= width:
        return values
    return torch.cat([values, torch.zeros(width - values.numel(), dtype=values.dtype)])
