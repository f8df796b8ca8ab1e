"""What an attribution reports of each sample beside its contribution, and the parts of the loss it attributes
separately: shared by the whole (`replay.attribution`) and the sharded (`replay.sharded_attribution`) attribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigations import AppliedConfig
from axrl_spike_replay.replay.rank_micro_batches import rank_forward, rank_loss_of
from axrl_spike_replay.replay.worker import RankInputs, config_loss, loss_batch
from axrl_spike_replay.training.policy_loss import LossOutput, expand_advantages


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


def router_loss(cfg: AppliedConfig, out: Any, rank: int) -> torch.Tensor | None:
    """Saved rank `rank`'s batch-level router losses as its loss adds them (its own coefficients and scale under a
    hypothesis); None when no loss of the config has any, so every rank (and process) agrees on whether there is one.
    On a rank the config leaves out it is still returned: the caller adds nothing of it (`RankLoss.kept`)."""
    if not any(loss.aux_loss_coef or loss.z_loss_coef for loss in cfg.losses()):
        return None
    own = cfg.loss_of(rank)
    loss = own.aux_loss_coef * out.aux_loss + own.z_loss_coef * out.z_loss
    if own.loss_scale is not None:
        loss = loss * own.loss_scale
    return loss if loss.requires_grad else None


@dataclass
class RankLoss:
    """One saved rank's forward and loss as an attribution takes them."""

    out: Any  # the policy's output; its log-probs (and entropy) keep their gradients after a backward
    batch: dict[str, torch.Tensor]  # what the loss saw (the saved batch filtered by the config)
    result: LossOutput
    router: torch.Tensor | None  # the batch-level router losses (`router_loss`)
    kept: bool = True  # False: the config leaves this rank out, and nothing of it (router terms included) counts


def rank_loss(model: torch.nn.Module, inputs: RankInputs, cfg: AppliedConfig, rank: int, counts: Any) -> RankLoss:
    """Saved rank `rank`'s forward (the saved batch, the config's routing) and the config's loss on the filtered
    batch, as in a replay (`worker.config_loss`, micro-batch by micro-batch: `rank_micro_batches`), with
    dLoss/dlogprobs and dLoss/dentropy kept for the attribution."""
    saved = inputs.batches[rank]
    out = rank_forward(model, inputs, cfg, rank, cfg.needs_entropy)
    batch = loss_batch(saved, rank, cfg, out.logprobs)
    out.logprobs.retain_grad()
    if out.entropy is not None:
        out.entropy.retain_grad()
    result = rank_loss_of(out, saved, rank, cfg, lambda view, part: config_loss(view, part, cfg, rank, counts))
    return RankLoss(out, batch, result, router_loss(cfg, out, rank), cfg.samples.keeps_rank(rank))


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    """`t`'s gradient after a backward, zeros where none reached it."""
    return t.grad.detach() if t.grad is not None else torch.zeros_like(t).detach()
