"""What an attribution reports of each sample beside its contribution, and the parts of the loss it attributes
separately: shared by the whole (`replay.attribution`) and the sharded (`replay.sharded_attribution`) attribution."""

from __future__ import annotations

from typing import Any

import torch

from axrl_spike_replay.experiment.mitigations import AppliedConfig
from axrl_spike_replay.training.policy_loss import expand_advantages


def rank_signals(
    rank: int, batch: dict[str, torch.Tensor], logprobs: torch.Tensor, mask: torch.Tensor, base: str
) -> list[dict[str, Any]]:
    """Per sample of a rank batch: what the attribution reports beside its contribution (advantage, reward, the
    largest |log-prob - base log-prob| on its loss tokens, loss tokens, group)."""
    adv = expand_advantages(batch["advantages"], logprobs.shape)
    tokens = mask.sum(dim=-1)
    log_ratio = ((logprobs - batch[f"{base}_logprobs"].float()).abs() * (mask > 0)).amax(dim=-1)
    rewards = batch.get("rewards")
    groups = batch.get("group_index")
    return [
        {
            "rank": rank,
            "sample": s,
            "advantage": float((adv[s] * mask[s]).sum() / tokens[s]) if tokens[s] > 0 else float(adv[s].mean()),
            "reward": float(rewards[s]) if rewards is not None else None,
            "max_abs_log_ratio_current_vs_base": float(log_ratio[s]),
            "loss_tokens": int(tokens[s]),
            "group": int(groups[s]) if groups is not None else None,
        }
        for s in range(logprobs.shape[0])
    ]


def base_name(cfg: AppliedConfig) -> str:
    """The stored log-probs the per-sample log-ratio is taken against under `cfg`."""
    return "old" if cfg.loss.mismatch_token_clip_max is not None else cfg.loss.is_base_logprobs


def router_loss(cfg: AppliedConfig, out: Any) -> torch.Tensor | None:
    """The rank's batch-level router losses as the policy loss adds them (None when both are off)."""
    loss = None
    if cfg.loss.aux_loss_coef:
        loss = cfg.loss.aux_loss_coef * out.aux_loss
    if cfg.loss.z_loss_coef:
        term = cfg.loss.z_loss_coef * out.z_loss
        loss = term if loss is None else loss + term
    return loss if loss is not None and loss.requires_grad else None
