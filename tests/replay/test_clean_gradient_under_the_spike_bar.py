"""Choosing between proven methods: the clean gradient they are measured against leaves single loss tokens out
of the loss, masked as the trainer masks a token, under either loss convention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from axrl_spike_replay.replay.sample_masks import SampleFilter, TokenDrop, filtered_batch
from axrl_spike_replay.snapshot.rank_data import load_rank_batch
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.policy_loss import local_counts, policy_loss
from axrl_spike_replay.training.verl_convention import response_horizon

# (loss config, whether the step's global counts are passed): each convention, and verl's fixed horizon
CONVENTIONS = {
    "axrl token-mean per rank": ({}, False),
    "verl token-mean global": ({"convention": "verl", "normalization": "global"}, True),
    "verl seq-mean-token-sum-norm global": (
        {"convention": "verl", "normalization": "global", "loss_agg_mode": "seq-mean-token-sum-norm"},
        True,
    ),
}


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_a_token_left_out_leaves_the_loss_and_its_denominators(spike_snapshot: Path, name: str) -> None:
    overrides, global_counts = CONVENTIONS[name]
    cfg = LossConfig(**overrides)
    batch = load_rank_batch(spike_snapshot, 0)
    on = batch["loss_mask"] > 0
    first = int(on.any(dim=0).nonzero()[0, 0])
    drop = torch.zeros_like(on)
    drop[:, first] = True  # every sample's first loss token: a horizon read off the mask would move
    drop[0, first + 3] = drop[2, first + 5] = True
    drop &= on
    logprobs = (batch["old_logprobs"] + 0.05 * torch.randn_like(batch["old_logprobs"])).requires_grad_()

    def loss(b: dict[str, Any]) -> tuple[Any, tuple[float, float]]:
        tokens, sequences = local_counts(b, cfg)
        counts = GlobalCounts(1, tokens, sequences) if global_counts else None
        return policy_loss(logprobs, b, cfg, counts=counts), (tokens, sequences)

    full, (tokens, sequences) = loss(batch)
    kept = filtered_batch(batch, 0, SampleFilter(tokens=TokenDrop({0: drop})))
    out, (kept_tokens, kept_sequences) = loss(kept)
    assert kept_tokens == tokens - int(drop.sum()) and kept_sequences == sequences
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    assert bool((grad[drop] == 0).all()) and bool((grad[on & ~drop] != 0).any())
    horizon = response_horizon(on, batch)
    assert response_horizon(kept["loss_mask"] > 0, kept) == horizon != response_horizon(on & ~drop)
    # the per-token losses of the tokens kept are unchanged; only the sum and its denominator lose the others
    kept_sum = float(full.per_token[on & ~drop].double().sum())
    expected = kept_sum / kept_tokens
    if cfg.loss_agg_mode == "seq-mean-token-sum-norm":
        expected = kept_sum / kept_sequences / horizon
    assert float(out.policy_loss.detach()) == pytest.approx(expected, rel=1e-6)
