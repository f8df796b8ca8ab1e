"""Per-sample and per-token signals of a snapshot's batch across ranks, with summaries and top-K outliers.

The importance ratio analysed is the rollout-vs-old one: log_ratio_old_vs_rollout = old_logprobs - rollout_logprobs
per loss token (the trainer's recomputed logprobs against the inference engine's), ratio_old_vs_rollout =
exp(log_ratio_old_vs_rollout); the per-sample figures and outlier lists carry the same `_old_vs_rollout` suffix
(experiment/figure_names.py: the replayed policy's own log-ratios are `current_vs_*`).
Signals are taken over loss tokens only. Fields are read under any accepted alias (verl, slime,
OpenRLHF, NeMo-RL names); a field absent from any rank is listed in `missing` with what it costs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.analysis.outliers import LOG_RATIO, TokenTable, concat_tables, top_k_indices
from axrl_spike_replay.analysis.routing_signals import routing_signals
from axrl_spike_replay.analysis.stats import describe
from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.snapshot.fields import FIELD_ALIASES, canonicalize_batch, find_field
from axrl_spike_replay.snapshot.layout import rank_files
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.safe_load import load_pt

if TYPE_CHECKING:
    import torch

OPTIONAL_FIELDS = {
    "advantages": "no advantage statistics, sign balance or advantage outliers",
    "old_logprobs": "no importance ratio (needs old and rollout logprobs)",
    "rollout_logprobs": "no rollout-vs-old importance ratio or log-ratio outliers",
    "ref_logprobs": "no KL to the reference policy",
    "rewards": "no reward statistics",
    "turn_index": "turn shown as null",
}
# Absent on every rank, these say the batch has no such structure (a single-turn batch has no turn index): nothing
# is missing then. Present on some ranks only, they are reported as the others are.
ABSENT_MEANS_NONE = frozenset({"turn_index"})


@dataclass
class BatchAnalysis:
    """What `analyze` reports. Sections are None where the fields they need are missing (see `missing`)."""

    path: str
    iteration: int
    grad_norm: float
    spike_ratio: float
    ranks: list[int]
    fields: dict[str, str]  # canonical name -> name as saved (first rank)
    missing: list[str]
    samples: dict[str, Any]
    tokens: dict[str, Any]
    logprobs: dict[str, Any]
    ratio_old_vs_rollout: dict[str, Any]  # the stored old against the stored rollout log-probs, per loss token
    advantages: dict[str, Any] | None
    sign_balance: dict[str, Any] | None
    rewards: dict[str, Any] | None
    routing: dict[str, Any]
    outliers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    top: int = 10

    @property
    def ratio(self) -> dict[str, Any]:
        """`ratio_old_vs_rollout` under its old name."""
        return self.ratio_old_vs_rollout


@dataclass
class _Rank:
    rank: int
    batch: dict[str, torch.Tensor]
    saved_names: dict[str, str]


def _load_ranks(directory: Path) -> list[_Rank]:
    files = rank_files(directory)["batch"]
    if not files:
        raise SnapshotError(f"{directory}: no batch_rank<r>.pt files")
    ranks = []
    for rank, path in files.items():
        raw = load_pt(path)
        micro = raw.get("micro_batches") if isinstance(raw, dict) else None
        first = micro[0] if isinstance(micro, (list, tuple)) and micro else raw
        saved = {}
        if isinstance(first, dict):
            saved = {name: found[0] for name in FIELD_ALIASES if (found := find_field(first, name)) is not None}
        ranks.append(_Rank(rank, canonicalize_batch(raw, path), saved))
    return ranks


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    import torch

    counts = mask.sum(dim=1)
    sums = torch.where(mask, values, torch.zeros_like(values)).sum(dim=1)
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, math.nan))


def _peak(key: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, the position of the largest key among loss tokens (NaN largest); -1 for rows without any."""
    import torch

    mags = torch.where(torch.isnan(key), torch.full_like(key, math.inf), key.abs())
    scored = torch.where(mask, mags, torch.full_like(mags, -1.0))
    return torch.where(mask.any(dim=1), scored.argmax(dim=1), torch.full_like(mask[:, 0], -1, dtype=torch.long))


def _rank_tables(r: _Rank, use: set[str]) -> tuple[TokenTable, dict[str, torch.Tensor]]:
    """(token table over loss tokens, per-sample columns) of one rank."""
    import torch

    b = r.batch
    tokens = b["tokens"]
    mask = b["loss_mask"] != 0
    n, t = tokens.shape
    rows, cols = torch.nonzero(mask, as_tuple=True)
    per_tok: dict[str, torch.Tensor] = {}
    if "advantages" in use:
        adv = b["advantages"].double()
        per_tok["advantage"] = adv[:, None].expand(n, t) if adv.dim() == 1 else adv
    for name in ("old", "rollout", "ref"):
        if f"{name}_logprobs" in use:
            per_tok[f"{name}_logprob"] = b[f"{name}_logprobs"].double()
    if "old_logprob" in per_tok and "rollout_logprob" in per_tok:
        per_tok[LOG_RATIO] = per_tok["old_logprob"] - per_tok["rollout_logprob"]
    turn = b["turn_index"].long() if "turn_index" in use else None
    table = TokenTable(
        rank=torch.full((rows.numel(),), r.rank, dtype=torch.long),
        sample=rows,
        position=cols,
        token_id=tokens[rows, cols].long(),
        turn=turn[rows, cols] if turn is not None else None,
        values={name: value[rows, cols] for name, value in per_tok.items()},
    )

    nan = torch.full((n,), math.nan, dtype=torch.float64)
    lr = per_tok.get(LOG_RATIO)
    peak_lr = _peak(lr, mask) if lr is not None else None
    if "advantage" in per_tok and b["advantages"].dim() == 2:
        # the largest |advantage| in the sample; among equal ones the largest |log-ratio|
        mags = torch.where(mask, per_tok["advantage"].abs(), torch.full_like(per_tok["advantage"], -1.0))
        at_max = mask & (mags == mags.max(dim=1, keepdim=True).values)
        peak_adv = _peak(lr, at_max) if lr is not None else _peak(per_tok["advantage"], mask)
    else:
        peak_adv = peak_lr if peak_lr is not None else _peak(mask.double(), mask)
    samples = {
        "rank": torch.full((n,), r.rank, dtype=torch.long),
        "sample": torch.arange(n),
        "loss_tokens": mask.sum(dim=1),
        "advantage": _masked_mean(per_tok["advantage"], mask) if "advantage" in per_tok else nan,
        "reward": _per_sample(b["rewards"], n) if "rewards" in use else nan,
        "seq_log_ratio_old_vs_rollout": _masked_mean(lr, mask) if lr is not None else nan,
        "max_abs_log_ratio_old_vs_rollout": _gather(lr.abs(), peak_lr)
        if lr is not None and peak_lr is not None
        else nan,
        "peak_lr": peak_lr if peak_lr is not None else torch.full((n,), -1, dtype=torch.long),
        "peak_adv": peak_adv,
        "num_turns": _num_turns(turn, mask) if turn is not None else torch.full((n,), -1, dtype=torch.long),
        "first_loss_position": _first_loss_position(mask),
        "_tokens": tokens.long(),
        "_turn": turn if turn is not None else torch.full((n, t), -1, dtype=torch.long),
    }
    if "group_index" in b and isinstance(b["group_index"], torch.Tensor) and b["group_index"].numel() == n:
        samples["group"] = b["group_index"].long().reshape(n)
    return table, samples


def _first_loss_position(mask: torch.Tensor) -> torch.Tensor:
    """[B] float64: each sample's first loss position (NaN for a sample without loss tokens)."""
    import torch

    positions = torch.arange(mask.shape[-1]).expand_as(mask)
    first = torch.where(mask, positions, torch.full_like(positions, mask.shape[-1])).amin(dim=-1).double()
    return torch.where(mask.any(dim=-1), first, torch.full_like(first, math.nan))


def _per_sample(value: torch.Tensor, n: int) -> torch.Tensor:
    """[B] or [B, T] (summed per sample) as float64 [B]."""
    value = value.double()
    return value.sum(dim=-1) if value.dim() == 2 else value.reshape(n)


def _gather(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    import torch

    picked = values.gather(1, positions.clamp(min=0)[:, None])[:, 0]
    return torch.where(positions >= 0, picked, torch.full_like(picked, math.nan))


def _num_turns(turn: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.tensor([int(torch.unique(turn[i][mask[i]]).numel()) for i in range(turn.shape[0])])


def _sample_rows(samples: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    rows = []
    for part in samples:
        for i in range(part["rank"].numel()):
            rows.append(_sample_row(part, i, "peak_lr"))
    return rows


def _sample_row(part: dict[str, torch.Tensor], i: int, peak: str) -> dict[str, Any]:
    def num(name: str) -> float | None:
        value = float(part[name][i])
        return None if math.isnan(value) else value

    position = int(part[peak][i])
    if position < 0 and peak != "peak_adv":
        position = int(part["peak_adv"][i])
    row: dict[str, Any] = {
        "rank": int(part["rank"][i]),
        "sample": int(part["sample"][i]),
        "loss_tokens": int(part["loss_tokens"][i]),
        "advantage": num("advantage"),
        "reward": num("reward"),
        "seq_log_ratio_old_vs_rollout": num("seq_log_ratio_old_vs_rollout"),
        "max_abs_log_ratio_old_vs_rollout": num("max_abs_log_ratio_old_vs_rollout"),
        "position": position if position >= 0 else None,
        "token_id": int(part["_tokens"][i, position]) if position >= 0 else None,
        "turn": int(part["_turn"][i, position]) if position >= 0 and int(part["_turn"][i, position]) >= 0 else None,
        "num_turns": int(part["num_turns"][i]) if int(part["num_turns"][i]) >= 0 else None,
        "first_loss_position": None if (first := num("first_loss_position")) is None else int(first),
    }
    if "group" in part:
        row["group"] = int(part["group"][i])
    return row


def _top_samples(samples: list[dict[str, torch.Tensor]], column: str, peak: str, k: int) -> list[dict[str, Any]]:
    import torch

    values = torch.cat([p[column] for p in samples])
    empty = torch.cat([p["loss_tokens"] for p in samples]) == 0
    if bool(empty.all()):
        return []
    # NaN ranks first (a NaN logprob is the outlier to see), except in samples without loss tokens
    values = torch.where(empty, torch.zeros_like(values), values)
    owners = [(j, i) for j, p in enumerate(samples) for i in range(p["rank"].numel())]
    secondary = torch.cat([p["max_abs_log_ratio_old_vs_rollout"] for p in samples])
    secondary = torch.where(empty, torch.zeros_like(secondary), secondary)
    chosen = top_k_indices(values, k, None if column == "max_abs_log_ratio_old_vs_rollout" else secondary)
    return [_sample_row(samples[owners[c][0]], owners[c][1], peak) for c in chosen.tolist()]


DOMINANCE_MARGIN = 0.1  # one sign's total must exceed the other's by 10 % to be called dominant


def _sign_balance(adv: torch.Tensor) -> dict[str, Any]:
    finite = adv.isfinite()
    non_finite = int(adv.numel() - int(finite.sum()))
    adv = adv[finite]  # one NaN would make both totals NaN: the balance is of the finite ones, the rest counted
    positive = float(adv.clamp(min=0).sum())
    negative = float((-adv).clamp(min=0).sum())
    # A side dominates only when it outweighs the other by DOMINANCE_MARGIN: GRPO's group-normalised
    # advantages sum to ~0, and a ratio of 0.99999999 is balance, not positive dominance.
    dominant = (
        "negative"
        if negative > positive * (1 + DOMINANCE_MARGIN)
        else "positive"
        if positive > negative * (1 + DOMINANCE_MARGIN)
        else "balanced"
    )
    return {
        "weighting": "per loss token, as the loss sees it",
        "positive_total": positive,
        "negative_total": negative,
        "negative_to_positive": negative / positive if positive else (math.inf if negative else None),
        "positive_tokens": int((adv > 0).sum()),
        "negative_tokens": int((adv < 0).sum()),
        "zero_tokens": int((adv == 0).sum()),
        "non_finite_tokens": non_finite,  # left out of the totals and counts above (the non_finite family reports them)
        "dominant": dominant,
    }


def analyze_snapshot(path: str | Path, top: int = 10) -> BatchAnalysis:
    """Batch signals of every rank of the snapshot at `path`, with top-`top` outlier tokens and samples."""
    import torch

    if top < 1:
        raise ConfigError(f"`top` must be >= 1, got {top}", "top")
    directory = Path(os.path.abspath(path))
    meta, _ = read_metadata(directory)
    ranks = _load_ranks(directory)
    missing: list[str] = []
    use: set[str] = set()
    for name, cost in OPTIONAL_FIELDS.items():
        have = [r.rank for r in ranks if name in r.batch]
        if len(have) == len(ranks):
            use.add(name)
            continue
        if not have and name in ABSENT_MEANS_NONE:
            continue
        where = "on any rank" if not have else f"on ranks {[r.rank for r in ranks if name not in r.batch]}"
        missing.append(f"{name} (accepted names: {', '.join(FIELD_ALIASES[name])}) not found {where}: {cost}")

    tables, samples = zip(*(_rank_tables(r, use) for r in ranks), strict=True)
    table = concat_tables(list(tables))
    sample_parts = list(samples)
    values = table.values
    masks = {r.rank: r.batch["loss_mask"] != 0 for r in ranks}
    loss_tokens = torch.cat([p["loss_tokens"] for p in sample_parts])
    total_tokens = sum(int(r.batch["tokens"].numel()) for r in ranks)

    tokens_doc: dict[str, Any] = {
        "total": total_tokens,
        "loss_tokens": int(table.rank.numel()),
        "loss_fraction": int(table.rank.numel()) / total_tokens if total_tokens else 0.0,
        "seq_len": sorted({int(r.batch["tokens"].shape[1]) for r in ranks}),
        "token_id": {
            "min": int(table.token_id.min()) if table.token_id.numel() else None,
            "max": int(table.token_id.max()) if table.token_id.numel() else None,
            "unique": int(torch.unique(table.token_id).numel()),
        },
        "per_turn": None,
    }
    if table.turn is not None:
        turns, counts = torch.unique(table.turn, return_counts=True)
        tokens_doc["per_turn"] = {int(t): int(c) for t, c in zip(turns.tolist(), counts.tolist(), strict=True)}

    logprobs: dict[str, Any] = {
        name: describe(values[f"{name}_logprob"]) if f"{name}_logprob" in values else None
        for name in ("old", "rollout", "ref")
    }
    if "old_logprob" in values and "ref_logprob" in values:
        delta = values["ref_logprob"] - values["old_logprob"]
        logprobs["old_vs_ref_kl_k3"] = float((delta.exp() - delta - 1).nanmean()) if delta.numel() else None

    ratio: dict[str, Any] = {"available": LOG_RATIO in values, "basis": "log_ratio = old_logprobs - rollout_logprobs"}
    if LOG_RATIO in values:
        lr = values[LOG_RATIO]
        ratio.update(
            log_ratio=describe(lr),
            abs_log_ratio=describe(lr.abs()),
            ratio=describe(lr.clamp(max=700).exp()),
            seq_log_ratio=describe(torch.cat([p["seq_log_ratio_old_vs_rollout"] for p in sample_parts])),
            fraction_outside={
                "0.5-2.0": float(((lr.abs() > math.log(2.0)) | torch.isnan(lr)).double().mean()) if lr.numel() else 0,
                "0.8-1.25": float(((lr.abs() > math.log(1.25)) | torch.isnan(lr)).double().mean()) if lr.numel() else 0,
            },
        )

    adv_doc = sign = None
    if "advantage" in values:
        per_sample = torch.cat([p["advantage"] for p in sample_parts])
        adv_doc = {
            "per_token": any(r.batch["advantages"].dim() == 2 for r in ranks),
            "tokens": describe(values["advantage"]),
            "samples": describe(per_sample),
            "zero_samples": int((per_sample == 0).sum()),
        }
        sign = _sign_balance(values["advantage"])

    rewards = describe(torch.cat([p["reward"] for p in sample_parts])) if "rewards" in use else None
    outliers: dict[str, list[dict[str, Any]]] = {
        "tokens_by_abs_log_ratio_old_vs_rollout": [],
        "tokens_by_abs_advantage": [],
        "samples_by_abs_log_ratio_old_vs_rollout": [],
        "samples_by_abs_advantage": [],
    }
    if LOG_RATIO in values:
        chosen = top_k_indices(values[LOG_RATIO], top, values.get("advantage"))
        outliers["tokens_by_abs_log_ratio_old_vs_rollout"] = table.records(chosen)
        outliers["samples_by_abs_log_ratio_old_vs_rollout"] = _top_samples(
            sample_parts, "max_abs_log_ratio_old_vs_rollout", "peak_lr", top
        )
    if "advantage" in values:
        chosen = top_k_indices(values["advantage"], top, values.get(LOG_RATIO))
        outliers["tokens_by_abs_advantage"] = table.records(chosen)
        outliers["samples_by_abs_advantage"] = _top_samples(sample_parts, "advantage", "peak_adv", top)

    routing = routing_signals(directory, masks)
    if not routing["available"]:
        missing.append("routing payloads (routing_payload_rank<r>.pt) not found: no routing metadata")
    return BatchAnalysis(
        path=str(directory),
        iteration=meta.iteration,
        grad_norm=meta.grad_norm,
        spike_ratio=meta.spike_ratio,
        ranks=[r.rank for r in ranks],
        fields=ranks[0].saved_names,
        missing=missing,
        samples={
            "count": int(loss_tokens.numel()),
            "per_rank": {r.rank: int(r.batch["tokens"].shape[0]) for r in ranks},
            "loss_tokens": describe(loss_tokens.double()),
            "without_loss_tokens": int((loss_tokens == 0).sum()),
            "rows": _sample_rows(sample_parts),
        },
        tokens=tokens_doc,
        logprobs=logprobs,
        ratio_old_vs_rollout=ratio,
        advantages=adv_doc,
        sign_balance=sign,
        rewards=rewards,
        routing=routing,
        outliers=outliers,
        top=top,
    )
