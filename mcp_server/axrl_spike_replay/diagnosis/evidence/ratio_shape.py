"""How the importance ratio between the stored old (trainer) and rollout (engine) log-probs is spread over a
snapshot's loss tokens, read from the batches alone: the evidence for suggesting the newer objectives.

- A sequence-level ratio (GSPO) is suggested where token ratios are extreme (outside [0.5, 2]) while the sequences
  holding them agree as wholes: their geometric-mean ratio, GSPO's sequence ratio, lies within the loss's clip
  range [1 - clip_eps_low, 1 + clip_eps_high], for at least half of them.
- CISPO is suggested where a few tokens' ratios dominate: the top 1 % of loss tokens (at least one) by
  |ratio - 1| carry at least half of the batch's total |ratio - 1|.

Both are comparisons of the stored signals with themselves, on any snapshot holding old and rollout log-probs; a
snapshot without them gives no shape, and nothing is suggested on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EXTREME = math.log(2.0)  # a token ratio outside [0.5, 2] is extreme (the ratio mask's default bounds)
TOP_FRACTION = 0.01  # "a few tokens": the top 1 % of loss tokens, at least one
DOMINATES = 0.5  # ... carrying at least half of the batch's total |ratio - 1|
AGREE = 0.5  # at least half of the sequences holding an extreme token agree as wholes


@dataclass(frozen=True)
class RatioShape:
    """The old-vs-rollout ratio's spread over the loss tokens of every rank of a snapshot."""

    loss_tokens: int
    extreme_tokens: int  # tokens whose ratio is outside [0.5, 2]
    extreme_sequences: int  # sequences holding at least one such token
    agreeing_sequences: int  # of those, sequences whose geometric-mean ratio is within [low, high]
    low: float  # the loss's clip range, 1 - clip_eps_low ...
    high: float  # ... and 1 + clip_eps_high
    top_tokens: int  # the top TOP_FRACTION of loss tokens by |ratio - 1|
    top_share: float  # their share of the total |ratio - 1| (0 when every ratio is 1)


def shape_of(ranks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], low: float, high: float) -> RatioShape:
    """The shape over `ranks`, each (loss mask [B, T], old log-probs [B, T], rollout log-probs [B, T]) as tensors;
    non-finite log-ratios count as extreme and as agreeing with nothing."""
    import torch

    tokens, extreme_seqs, agreeing, excess = 0, 0, 0, []
    extreme = 0
    for mask, old, rollout in ranks:
        on = mask != 0
        log_ratio = torch.where(on, old.double() - rollout.double(), torch.zeros((), dtype=torch.float64))
        finite = torch.isfinite(log_ratio)
        far = on & (~finite | (log_ratio.abs() > EXTREME))
        counts = on.sum(dim=-1)
        seq_mean = torch.where(finite, log_ratio, torch.zeros(())).sum(dim=-1) / counts.clamp(min=1)
        whole = on.any(dim=-1) & (finite | ~on).all(dim=-1)
        above = seq_mean >= math.log(low) if low > 0 else torch.ones_like(whole)  # clip_eps_low >= 1: no lower end
        within = whole & above & (seq_mean <= math.log(high))
        holding = far.any(dim=-1)
        tokens += int(on.sum())
        extreme += int(far.sum())
        extreme_seqs += int(holding.sum())
        agreeing += int((holding & within).sum())
        ratio_excess = (log_ratio[on & finite].clamp(max=700.0).exp() - 1.0).abs()
        excess.append(torch.cat([ratio_excess, torch.full((int((on & ~finite).sum()),), math.inf)]))
    values = torch.cat(excess) if excess else torch.zeros(0, dtype=torch.float64)
    top = max(1, math.ceil(TOP_FRACTION * values.numel())) if values.numel() else 0
    total = float(values.sum())
    if not math.isfinite(total):  # a non-finite ratio dominates whatever else there is
        share = 1.0
    else:
        share = float(values.topk(top).values.sum()) / total if top and total > 0 else 0.0
    return RatioShape(tokens, extreme, extreme_seqs, agreeing, low, high, top, share)


def read_ratio_shape(snapshot: str | Path, low: float, high: float) -> RatioShape | None:
    """The shape of the snapshot's stored batches (every rank); None when any rank lacks old or rollout log-probs."""
    from axrl_spike_replay.snapshot.fields import canonicalize_batch
    from axrl_spike_replay.snapshot.layout import rank_files
    from axrl_spike_replay.snapshot.safe_load import load_pt

    ranks = []
    for path in rank_files(Path(snapshot))["batch"].values():
        batch = canonicalize_batch(load_pt(path), path)
        if not {"loss_mask", "old_logprobs", "rollout_logprobs"} <= set(batch):
            return None
        ranks.append((batch["loss_mask"], batch["old_logprobs"], batch["rollout_logprobs"]))
    return shape_of(ranks, low, high) if ranks else None


def sequences_agree(shape: RatioShape) -> str | None:
    """The evidence for a sequence-level ratio (GSPO) in words, None where the shape does not point to it."""
    if not shape.extreme_tokens or shape.agreeing_sequences < AGREE * shape.extreme_sequences:
        return None
    return (
        f"{shape.extreme_tokens} of {shape.loss_tokens} loss tokens have a stored old/rollout ratio outside [0.5, 2], "
        f"in {shape.extreme_sequences} sequences, {shape.agreeing_sequences} of which agree as wholes (geometric-mean "
        f"ratio within the clip range [{shape.low:g}, {shape.high:g}])"
    )


def few_tokens_dominate(shape: RatioShape) -> str | None:
    """The evidence for CISPO's clipped weights in words, None where the shape does not point to it."""
    if shape.top_share < DOMINATES:
        return None
    return (
        f"the top {shape.top_tokens} of {shape.loss_tokens} loss tokens by |ratio - 1| (stored old vs rollout) carry "
        f"{shape.top_share:.0%} of the batch's total"
    )
