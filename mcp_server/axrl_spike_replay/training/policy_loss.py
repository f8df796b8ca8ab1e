"""The GRPO/PPO policy loss the reference trainer trains with and the replay engine recomputes.

One implementation serves both, so a replay with no mitigation is bit-identical to training.
Every knob defaults to "off"; the mitigations are knobs set only for a replay. `policy_loss`
dispatches on the run's convention: `axrl` (this module, today's behaviour) or `verl`
(`training/verl_convention.py`, verl 0.9.1's loss). Under `normalization: global` every rank
normalises by the step's global counts (`GlobalCounts`) instead of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.loss_config import LOSS_AGG_MODES, LossConfig, rejection_options, rollout_is_setting
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.policy_objectives import objective_loss
from axrl_spike_replay.training.trl_convention import trl_policy_loss
from axrl_spike_replay.training.verl_convention import (
    kl_penalty,
    masked,
    rollout_is_weights,
    verl_local_counts,
    verl_policy_loss,
)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar the rank backpropagates (policy loss + router losses)
    policy_loss: torch.Tensor
    per_token: torch.Tensor  # [B, T] per-token policy loss (detached), 0 off the mask
    mask: torch.Tensor  # [B, T] float mask actually used
    metrics: dict[str, float]


def expand_advantages(advantages: torch.Tensor, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B] or [B, T] advantages as [B, T] float (float32 unless `dtype`)."""
    adv = advantages.to(dtype)
    return adv[:, None].expand(shape) if adv.dim() == 1 else adv


def balance_negatives(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scale negative advantages so their total masked magnitude matches the positives'."""
    positive = (adv.clamp(min=0) * mask).sum()
    negative = ((-adv).clamp(min=0) * mask).sum()
    if negative <= positive:
        return adv
    scale = positive / negative
    return torch.where(adv < 0, adv * scale, adv)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, counts: GlobalCounts | None = None
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar with one of LOSS_AGG_MODES (the axrl convention).

    With `counts` (normalization global) the rank's token or sequence count is replaced by the step's
    global count times the DP size, so the DP mean of the gradients is the global mean's gradient.
    """
    values = masked(per_token, mask > 0)  # torch.where: a NaN or inf off the mask never reaches the sum
    dp = counts.dp_size if counts is not None else 1
    if mode == "token-mean":
        if counts is not None:
            return values.sum() / max(counts.batch_num_tokens, 1.0) * dp
        return values.sum() / mask.sum().clamp(min=1.0)
    seq_tokens = mask.sum(dim=-1)
    has_tokens = (seq_tokens > 0).float()
    n_seqs = has_tokens.sum().clamp(min=1.0)
    if counts is not None and mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        n_seqs = torch.tensor(max(counts.global_batch_size, 1.0) / dp, dtype=values.dtype, device=values.device)
    if mode == "seq-mean-token-mean":
        return ((values.sum(dim=-1) / seq_tokens.clamp(min=1.0)) * has_tokens).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return values.sum(dim=-1).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        return values.sum() / float(mask.shape[-1])  # no count in it: the same under either normalisation
    raise ConfigError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {shown(mode, 60)}")


def local_counts(batch: dict[str, torch.Tensor], cfg: LossConfig) -> tuple[float, float]:
    """This rank's (loss tokens, sequences) as its convention counts them: its share of the global counts."""
    if cfg.convention == "verl":
        return verl_local_counts(batch, cfg)
    mask = batch["loss_mask"].float()
    return float(mask.sum()), float((mask.sum(dim=-1) > 0).sum())


def _step_counts(cfg: LossConfig, counts: GlobalCounts | None) -> GlobalCounts | None:
    if cfg.normalization != "global":
        return None
    if counts is None:
        raise ConfigError(
            "loss.normalization is global but the step's global counts were not given (a snapshot records them "
            "in grad_info_rank<r>.pt as global_batch_info)"
        )
    return counts


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
    counts: GlobalCounts | None = None,
) -> LossOutput:
    """GRPO/PPO clipped surrogate with optional dual clip, KL, entropy, router losses and mitigations.

    `logprobs` [B, T] are the current policy's token logprobs (aligned with `batch["tokens"]`);
    `counts` the step's global counts, needed (and used) under `normalization: global`.
    """
    step_counts = _step_counts(cfg, counts)
    mask = batch["loss_mask"].float()
    on_mask = mask > 0
    adv = expand_advantages(_require(batch, "advantages", "the policy loss"), logprobs.shape)
    if cfg.convention in ("verl", "trl"):  # both keep the advantages' precision (float64 in the cross-checks)
        adv = expand_advantages(batch["advantages"], logprobs.shape, logprobs.dtype)
    adv = masked(adv, on_mask)
    if cfg.balance_negative_advantages:
        adv = balance_negatives(adv, mask)
    if cfg.advantage_clip is not None:
        adv = adv.clamp(-cfg.advantage_clip, cfg.advantage_clip)
    if cfg.convention == "trl":
        return _trl(logprobs, batch, cfg, adv, entropy, aux_loss)
    if cfg.convention == "verl":
        return _verl(logprobs, batch, cfg, adv, entropy, aux_loss, z_loss, step_counts)
    # Values off the mask (padding: -inf logprobs, NaN) are zeroed before any arithmetic, so neither
    # the loss nor the gradient sees them; on the mask nothing changes.
    logprobs = masked(logprobs, on_mask)
    if entropy is not None:
        entropy = masked(entropy, on_mask)
    batch = {
        k: masked(v.float(), on_mask) if k.endswith("_logprobs") and v.shape == on_mask.shape else v
        for k, v in batch.items()
    }

    weight = torch.ones_like(logprobs)
    base_name = cfg.is_base_logprobs
    if cfg.mismatch_token_clip_max is not None:
        # Truncated importance sampling: the ratio is taken against the trainer's old logprobs and
        # the rollout/trainer mismatch is carried only by a capped, detached per-token weight.
        old = _require(batch, "old_logprobs", "mismatch_token_clip_max")
        rollout = _require(batch, "rollout_logprobs", "mismatch_token_clip_max")
        weight = (old - rollout).exp().clamp(max=cfg.mismatch_token_clip_max).detach()
        base_name = "old"
    elif cfg.rollout_is is not None:
        # verl's rollout correction (token or sequence TIS, IcePop), the same weights as under convention verl
        old = _require(batch, "old_logprobs", "rollout_is")
        rollout = _require(batch, "rollout_logprobs", "rollout_is")
        setting = rollout_is_setting(cfg)
        assert setting is not None
        weight = rollout_is_weights(old - rollout, on_mask, *setting)
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
    if cfg.policy_loss_mode == "vanilla":
        ratio = log_ratio.exp()
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
        per_token = torch.maximum(unclipped, clipped)
        if cfg.dual_clip_c is not None:
            per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * cfg.dual_clip_c), per_token)
    else:  # GSPO, CISPO, SAPO as verl forms them, without verl's safety clamps (training/policy_objectives.py)
        terms = objective_loss(cfg.policy_loss_mode, logprobs, log_ratio, adv, mask, cfg, safety_bound=None)
        per_token, ratio = terms.per_token, terms.ratio
    per_token = per_token * weight
    kl_value = 0.0
    if cfg.kl_coef:
        ref_lp = _require(batch, "ref_logprobs", "kl_coef")
        kl = axrl_kl(logprobs, ref_lp, cfg)
        per_token = per_token + cfg.kl_coef * kl
        kl_value = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1.0))
    if cfg.entropy_coef:
        if entropy is None:
            raise ConfigError("entropy_coef is set but no entropy was computed")
        per_token = per_token - cfg.entropy_coef * entropy

    pg = aggregate(per_token, mask, cfg.loss_agg_mode, step_counts)
    loss = _with_router_losses(pg, cfg, aux_loss, z_loss)

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
            # named for what they compare (experiment/figure_names.py): this figure's base is the ratio's own
            f"max_abs_log_ratio_current_vs_{base_name}": float(lr[on].abs().max()) if on.any() else 0.0,
            "mean_weight": float(weight[on].mean()) if on.any() else 1.0,
            "kl_current_vs_ref": kl_value,
        }
    per_token_out = masked(per_token.detach(), mask > 0)
    return LossOutput(loss=loss, policy_loss=pg, per_token=per_token_out, mask=mask, metrics=metrics)


def axrl_kl(logprobs: torch.Tensor, ref: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """The axrl convention's per-token KL: k3 = exp(ref - logp) - (ref - logp) - 1, unclamped, by default; any other
    `kl_estimator` is verl's `kl_penalty` (so `low_var_kl` is verl's k3, clamped at +-10); `kl_clamp` bounds it."""
    if cfg.kl_estimator == "k3":
        delta = ref - logprobs
        kl = delta.exp() - delta - 1.0  # >= 0
        return kl if cfg.kl_clamp is None else kl.clamp(-cfg.kl_clamp, cfg.kl_clamp)
    return kl_penalty(logprobs, ref, cfg.kl_estimator, cfg.kl_clamp)


def _with_router_losses(
    pg: torch.Tensor, cfg: LossConfig, aux_loss: torch.Tensor | None, z_loss: torch.Tensor | None
) -> torch.Tensor:
    loss = pg
    if aux_loss is not None and cfg.aux_loss_coef:
        loss = loss + cfg.aux_loss_coef * aux_loss
    if z_loss is not None and cfg.z_loss_coef:
        loss = loss + cfg.z_loss_coef * z_loss
    if cfg.loss_scale is not None:
        loss = loss * cfg.loss_scale
    return loss


def _verl(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    cfg: LossConfig,
    adv: torch.Tensor,
    entropy: torch.Tensor | None,
    aux_loss: torch.Tensor | None,
    z_loss: torch.Tensor | None,
    counts: GlobalCounts | None,
) -> LossOutput:
    """The verl convention's loss plus the router losses, in this module's output shape."""
    _require(batch, "old_logprobs", "convention verl (its ratio is against old_log_probs)")
    if rollout_is_setting(cfg) is not None or rejection_options(cfg):
        _require(batch, "rollout_logprobs", "verl's rollout correction")
    if cfg.kl_coef:
        _require(batch, "ref_logprobs", "kl_coef")
    out = verl_policy_loss(logprobs, batch, cfg, adv, entropy, counts)
    loss = _with_router_losses(out.loss, cfg, aux_loss, z_loss)
    mask = out.mask.to(logprobs.dtype)
    with torch.no_grad():
        on = out.mask
        lr = logprobs.detach() - batch["old_logprobs"].to(logprobs.dtype)
        metrics = {
            "loss_tokens": float(on.sum()),
            "policy_loss": float(out.pg_loss.detach()),
            "clip_fraction": out.metrics["pg_clipfrac"],
            "max_abs_log_ratio_current_vs_old": float(lr[on].abs().max()) if on.any() else 0.0,
            "mean_weight": out.metrics["mean_is_weight"],
            "kl_current_vs_ref": out.metrics.get("kl", 0.0),
            "rejected_tokens": out.metrics["rejected_tokens"],
        }
    return LossOutput(loss=loss, policy_loss=out.pg_loss, per_token=out.per_token, mask=mask, metrics=metrics)


def _trl(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    cfg: LossConfig,
    adv: torch.Tensor,
    entropy: torch.Tensor | None,
    aux_loss: torch.Tensor | None,
) -> LossOutput:
    """The trl convention's loss plus TRL's router loss (one micro-batch: `check_trl_settings`), in this module's
    output shape."""
    if cfg.kl_coef:
        _require(batch, "ref_logprobs", "kl_coef (TRL's beta)")
    out = trl_policy_loss(logprobs, batch, cfg, adv, entropy)
    loss = _with_router_losses(out.loss, cfg, aux_loss, None)
    on = batch["loss_mask"] > 0
    with torch.no_grad():
        base = batch.get("old_logprobs")
        lr = logprobs.detach() - (base.to(logprobs.dtype) if base is not None else logprobs.detach())
        metrics = {
            "loss_tokens": float(on.sum()),
            "policy_loss": float(out.pg_loss.detach()),
            "clip_fraction": out.metrics["clip_fraction"],
            "max_abs_log_ratio_current_vs_old": float(lr[on].abs().max()) if on.any() else 0.0,
            "kl_current_vs_ref": out.metrics["kl"],
        }
    mask = on.to(logprobs.dtype)
    return LossOutput(loss=loss, policy_loss=out.pg_loss, per_token=out.per_token, mask=mask, metrics=metrics)
