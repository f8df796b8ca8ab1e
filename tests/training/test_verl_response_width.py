"""A verl mini-batch whose responses all start with masked tokens (a tool reply, a masked turn): verl's
`seq-mean-token-sum-norm` divides by the response width R of its `[B, R]` fields, which our full-width
layout no longer shows. Read through `canonicalize_batch`, the batch keeps R and our verl convention
matches verl 0.9.1's own `ppo_loss` on it (float64, 1e-7 relative)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from verl_cases import BATCH, PROMPT, RESPONSE, Case, our_config, rank_batch, verl_step

from axrl_spike_replay.snapshot.fields import RESPONSE_WIDTH, canonicalize_batch
from axrl_spike_replay.training.policy_loss import policy_loss

CASE = Case({}, mode="seq-mean-token-sum-norm", normalization="per_rank")


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    from verl_peer import load_verl, skip_unless_installed

    skip_unless_installed()
    return load_verl()


def masked_start(rank: int) -> dict[str, torch.Tensor]:
    r = rank_batch(rank)
    r["response_mask"] = r["response_mask"].clone()
    r["response_mask"][:, :2] = False  # no sequence takes a loss on its first two response tokens
    return r


def ours_on_the_verl_batch(r: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor, dict[str, Any]]:
    raw = {
        "input_ids": torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.long),
        "response_mask": r["response_mask"],
        "old_log_probs": r["old_log_probs"],
        "rollout_log_probs": r["rollout_log_probs"],
        "ref_log_prob": r["ref_log_prob"],
        "advantages": r["advantages"],
    }
    batch = canonicalize_batch(raw, "batch_rank0.pt")
    logprobs = torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.float64)
    logprobs[:, PROMPT:] = r["log_probs"]
    logprobs.requires_grad_(True)
    loss = policy_loss(logprobs, batch, our_config(CASE)).loss
    loss.backward()
    assert logprobs.grad is not None
    return float(loss.detach()), logprobs.grad[:, PROMPT:], batch


def test_the_response_width_reaches_seq_mean_token_sum_norm(verl: dict[str, Any]) -> None:
    ranks = [masked_start(rank) for rank in (0, 1)]
    theirs = verl_step(CASE, ranks, verl)
    for r, (verl_loss, verl_grad) in zip(ranks, theirs, strict=True):
        loss, grad, batch = ours_on_the_verl_batch(r)
        assert int(batch[RESPONSE_WIDTH]) == RESPONSE
        assert abs(loss - verl_loss) <= 1e-7 * abs(verl_loss)
        assert float((grad - verl_grad).abs().max()) <= 1e-7 * float(verl_grad.abs().max())


def test_without_the_width_the_horizon_would_start_at_the_first_loss_column() -> None:
    _, _, batch = ours_on_the_verl_batch(masked_start(0))
    with_width = policy_loss(torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.float64), batch, our_config(CASE))
    del batch[RESPONSE_WIDTH]
    without = policy_loss(torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.float64), batch, our_config(CASE))
    assert float(without.loss) == pytest.approx(float(with_width.loss) * RESPONSE / (RESPONSE - 2), rel=1e-12)
