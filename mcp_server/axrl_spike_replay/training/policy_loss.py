"""The GRPO/PPO policy loss the reference trainer trains with and the replay engine recomputes.

One implementation serves both, so a replay with no mitigation is bit-identical to training.
Every knob defaults to "off"; the mitigations are knobs set only for a replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.loss_config import LOSS_AGG_MODES, LossConfig


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar the rank backpropagates (policy loss + router losses)
    policy_loss: torch.Tensor
    per_token: torch.Tensor  # [B, T] per-token policy loss (detached), 0 off the mask
    mask: torch.Tensor  # [B, T] float mask actually used
    metrics: dict[str, float]


def expand_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[B] or [B, T] advantages as [B, T] float."""
    adv = advantages.float()
    return adv[:, None].expand(shape) if adv.dim() == 1 else adv


def balance_negatives(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scale negative advantages so their total masked magnitude matches the positives'."""
    positive = (adv.clamp(min=0) * mask).sum()
    negative = ((-adv).clamp(min=0) * mask).sum()
    if negative <= positive:
        return adv
    scale = positive / negative
    return torch.where(adv < 0, adv * scale, adv)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar with one of LOSS_AGG_MODES."""
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1.0)
    seq_tokens = mask.sum(dim=-1)
    has_tokens = (seq_tokens > 0).float()
    n_seqs = has_tokens.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        return ((masked.sum(dim=-1) / seq_tokens.clamp(min=1.0)) * has_tokens).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return masked.sum(dim=-1).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / float(mask.shape[-1])
    raise ConfigError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def _require(batch: dict[str, torch.Tensor], name: str, why: str) -> torch.Tensor:
    if name not in batch:
        raise ConfigError(f"batch has no {name!r}, needed for {why}")
    return batch[name].float()


def policy_loss(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    cfg: LossConfig,
    entropy: torch.Tensor | None = None,
    aux_loss: torch.Tensor | None = None,
    z_loss: torch.Tensor | None = None,
) -> LossOutput:
    """GRPO/PPO clipped surrogate with optional dual clip, KL, entropy, router losses and mitigations.

    `logprobs` [B, T] are the current policy's token logprobs (aligned with `batch["tokens"]`).
    """
    mask = batch["loss_mask"].float()
    adv = expand_advantages(_require(batch, "advantages", "the policy loss"), logprobs.shape)
    if cfg.balance_negative_advantages:
        adv = balance_negatives(adv, mask)
    if cfg.advantage_clip is not None:
        adv = adv.clamp(-cfg.advantage_clip, cfg.advantage_clip)

    weight = torch.ones_like(logprobs)
    base_name = cfg.is_base_logprobs
    if cfg.mismatch_token_clip_max is not None:
        # Truncated importance sampling: the ratio is taken against the trainer's old logprobs and
        # the rollout/trainer mismatch is carried only by a capped, detached per-token weight.
        old = _require(batch, "old_logprobs", "mismatch_token_clip_max")
        rollout = _require(batch, "rollout_logprobs", "mismatch_token_clip_max")
        weight = (old - rollout).exp().clamp(max=cfg.mismatch_token_clip_max).detach()
        base_name = "old"
    base = _require(batch, f"{base_name}_logprobs", f"is_base_logprobs={base_name}")

    if cfg.ratio_outlier_mask is not None:
        spec = cfg.ratio_outlier_mask
        ref = _require(batch, f"{spec.base}_logprobs", "ratio_outlier_mask")
        log_r = (logprobs.detach() - ref) * mask
        if spec.level == "sequence":
            log_r = (log_r.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0))[:, None].expand_as(mask)
        ratio_m = log_r.exp()
        mask = mask * ((ratio_m >= spec.low) & (ratio_m <= spec.high)).float()

    log_ratio = logprobs - base
    if cfg.log_ratio_clip is not None:
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clip, cfg.log_ratio_clip)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if cfg.dual_clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * cfg.dual_clip_c), per_token)
    per_token = per_token * weight
    kl_value = 0.0
    if cfg.kl_coef:
        ref_lp = _require(batch, "ref_logprobs", "kl_coef")
        delta = ref_lp - logprobs
        kl = delta.exp() - delta - 1.0  # k3 estimator, >= 0
        per_token = per_token + cfg.kl_coef * kl
        kl_value = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1.0))
    if cfg.entropy_coef:
        if entropy is None:
            raise ConfigError("entropy_coef is set but no entropy was computed")
        per_token = per_token - cfg.entropy_coef * entropy

    pg = aggregate(per_token, mask, cfg.loss_agg_mode)
    loss = pg
    if aux_loss is not None and cfg.aux_loss_coef:
        loss = loss + cfg.aux_loss_coef * aux_loss
    if z_loss is not None and cfg.z_loss_coef:
        loss = loss + cfg.z_loss_coef * z_loss

    with torch.no_grad():
        n_tokens = float(mask.sum())
        on = mask > 0
        lr = (logprobs - base).detach()
        metrics = {
            "loss_tokens": n_tokens,
            "policy_loss": float(pg),
            "clip_fraction": float(((ratio.detach() - 1).abs() > cfg.clip_eps_high).float()[on].mean())
            if on.any()
            else 0.0,
            "max_abs_log_ratio": float(lr[on].abs().max()) if on.any() else 0.0,
            "mean_weight": float(weight[on].mean()) if on.any() else 1.0,
            "kl": kl_value,
        }
    return LossOutput(loss=loss, policy_loss=pg, per_token=(per_token.detach() * mask), mask=mask, metrics=metrics)
