"""What an attribution reports of each sample beside its contribution, and the parts of the loss it attributes
separately: shared by the whole (`replay.attribution`) and the sharded (`replay.sharded_attribution`) attribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigations import AppliedConfig
from axrl_spike_replay.models.policy import policy_forward
from axrl_spike_replay.replay.worker import RankInputs, loss_batch
from axrl_spike_replay.training.policy_loss import LossOutput, expand_advantages, policy_loss


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


@dataclass
class RankLoss:
    """One saved rank's forward and loss as an attribution takes them."""

    out: Any  # the policy's output; its log-probs (and entropy) keep their gradients after a backward
    batch: dict[str, torch.Tensor]  # what the loss saw (the saved batch filtered by the config)
    result: LossOutput
    router: torch.Tensor | None  # the batch-level router losses (`router_loss`)


def rank_loss(model: torch.nn.Module, inputs: RankInputs, cfg: AppliedConfig, rank: int, counts: Any) -> RankLoss:
    """Saved rank `rank`'s forward (the saved batch, the config's routing) and the config's loss on the filtered
    batch, as in a replay, with dLoss/dlogprobs and dLoss/dentropy kept for the attribution."""
    saved = inputs.batches[rank]
    out = policy_forward(model, saved, inputs.routing(cfg, rank), need_entropy=bool(cfg.loss.entropy_coef))
    batch = loss_batch(saved, rank, cfg, out.logprobs)
    out.logprobs.retain_grad()
    if out.entropy is not None:
        out.entropy.retain_grad()
    result = policy_loss(
        out.logprobs, batch, cfg.loss, entropy=out.entropy, aux_loss=out.aux_loss, z_loss=out.z_loss, counts=counts
    )
    return RankLoss(out, batch, result, router_loss(cfg, out))


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    """`t`'s gradient after a backward, zeros where none reached it."""
    return t.grad.detach() if t.grad is not None else torch.zeros_like(t).detach()
