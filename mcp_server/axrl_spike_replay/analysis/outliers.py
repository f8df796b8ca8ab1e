"""Top-K outlier selection over the loss tokens (and samples) of every rank, with where each one sits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LOG_RATIO = "log_ratio_old_vs_rollout"  # old - rollout per loss token: the two stored log-probs it compares
TOKEN_COLUMNS = ("advantage", LOG_RATIO, "old_logprob", "rollout_logprob", "ref_logprob")


def _key(values: torch.Tensor) -> torch.Tensor:
    """|values| with NaN ranked largest: a NaN logprob is itself the outlier to see first."""
    import torch

    mags = values.double().abs()
    return torch.where(torch.isnan(mags), torch.full_like(mags, math.inf), mags)


def top_k_indices(primary: torch.Tensor, k: int, secondary: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the `k` largest |primary| (NaN first), ties broken by the larger |secondary|."""
    import torch

    key = _key(primary)
    if k <= 0 or key.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if key.numel() > k:
        threshold = torch.topk(key, k).values[-1]
        candidates = torch.nonzero(key >= threshold).reshape(-1)
    else:
        candidates = torch.arange(key.numel())
    if secondary is not None:
        order = torch.sort(_key(secondary)[candidates], descending=True, stable=True).indices
        candidates = candidates[order]
    order = torch.sort(key[candidates], descending=True, stable=True).indices
    return candidates[order][:k]


@dataclass
class TokenTable:
    """Flat columns over the loss tokens of all ranks. Value columns are float64, NaN where unavailable."""

    rank: torch.Tensor
    sample: torch.Tensor
    position: torch.Tensor
    token_id: torch.Tensor
    turn: torch.Tensor | None  # None when no rank has `turn_index`
    values: dict[str, torch.Tensor]  # TOKEN_COLUMNS present

    def records(self, indices: torch.Tensor) -> list[dict[str, Any]]:
        """One dict per index: rank, sample, position, token_id, turn, the value columns and ratio_old_vs_rollout
        (None if absent)."""
        rows = []
        for i in indices.tolist():
            row: dict[str, Any] = {
                "rank": int(self.rank[i]),
                "sample": int(self.sample[i]),
                "position": int(self.position[i]),
                "token_id": int(self.token_id[i]),
                "turn": int(self.turn[i]) if self.turn is not None else None,
            }
            for name in TOKEN_COLUMNS:
                column = self.values.get(name)
                value = float(column[i]) if column is not None else math.nan
                row[name] = None if math.isnan(value) else value
            row["ratio_old_vs_rollout"] = math.exp(min(row[LOG_RATIO], 700.0)) if row[LOG_RATIO] is not None else None
            rows.append(row)
        return rows


def concat_tables(parts: list[TokenTable]) -> TokenTable:
    """One table from per-rank tables (value columns missing on a rank become NaN there)."""
    import torch

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(p, name) for p in parts]) if parts else torch.zeros(0, dtype=torch.long)

    names = [n for n in TOKEN_COLUMNS if any(n in p.values for p in parts)]
    values = {
        name: torch.cat(
            [p.values[name] if name in p.values else torch.full((p.rank.numel(),), math.nan) for p in parts]
        ).double()
        for name in names
    }
    turn = None
    if any(p.turn is not None for p in parts):
        turn = torch.cat([p.turn if p.turn is not None else torch.full_like(p.rank, -1) for p in parts])
    return TokenTable(cat("rank"), cat("sample"), cat("position"), cat("token_id"), turn, values)
