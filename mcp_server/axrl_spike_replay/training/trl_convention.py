"""TRL 1.16's GRPO loss, as `trl.GRPOTrainer._compute_loss` computes it, on one process's batch of a step.

Every `loss_type` TRL ships (grpo, dapo, dr_grpo, bnpo, cispo, sapo, luspo, vespo), the token- or sequence-level
importance ratio (GSPO), `epsilon` / `epsilon_high`, two-sided clipping (`delta`), SAPO's temperatures, VESPO's
gamma weights, the k3 KL term with TRL's bias correction (`use_bias_correction_kl`), the off-policy sequence mask,
the rollout correction (`vllm_importance_sampling_mode`: token or sequence, truncate or mask, with its caps), the
static entropy bonus and each loss type's normaliser: the micro-batch's own counts divided by the step's
gradient-accumulation steps, or (dapo, cispo, vespo) TRL's `num_items_in_batch` over the processes and the
generation's accumulation window.

A step of TRL is `gradient_accumulation_steps` micro-batches per process, each its own `_compute_loss`; a snapshot
holds them concatenated with a `micro_batch` index per row, and the loss here is the sum of TRL's loss on each
micro-batch (the gradient the process accumulated before the optimizer step). Our batches hold prompt + completion
columns; every quantity is per token on the loss mask, so the layout shows nowhere. The rollout correction's
ratio is the one the batch recorded (`importance_sampling_ratio`, as TRL's generation computed it) unless a
mitigation names a correction of its own, which is then computed from old vs rollout log-probs as TRL's
`_generate_and_score_completions` does. Checked against TRL's own installed `_compute_loss` in
tests/training/test_trl_crosscheck.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.loss_config import LossConfig, trl_rollout_correction
from axrl_spike_replay.training.trl_settings import NUM_ITEMS_LOSS_TYPES, TrlSettings
from axrl_spike_replay.training.verl_convention import masked

IS_RATIO = "importance_sampling_ratio"  # TRL's name for the rollout correction's ratio, as its loss consumed it
MICRO_BATCH = "micro_batch"  # [B] index of the micro-batch each row was in (a capture of TRL writes it)
NUM_ITEMS = "num_items_in_batch"  # TRL's loss tokens of the generation batch over every process (0-dim)
VESPO_LOWER = math.log(1e-8)  # TRL's lower clamp of VESPO's log-weights


@dataclass
class TrlLoss:
    loss: torch.Tensor  # the sum over micro-batches of TRL's loss (its gradient is the process's accumulated one)
    pg_loss: torch.Tensor  # the same without the entropy bonus
    per_token: torch.Tensor  # [B, T] per-token losses (detached), 0 off the mask
    metrics: dict[str, float]


def rollout_correction_ratio(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, mode: str, low: float | None, high: float | None
) -> torch.Tensor:
    """TRL's `importance_sampling_ratio` pi_old/pi_rollout: [B, T] (token modes) or [B, 1] (sequence modes),
    clamped to [low, high] (truncate) or 0 outside them (mask); NaN rollout log-probs count as no mismatch."""
    diff = torch.nan_to_num(masked(old - rollout, mask > 0), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = diff.exp()
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    lower = -math.inf if low is None else low
    upper = math.inf if high is None else high
    return ratio.masked_fill((ratio < lower) | (ratio > upper), 0.0)


def _recorded_ratio(batch: Mapping[str, Any], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    value = batch.get(IS_RATIO)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != shape[0]:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"batch field {IS_RATIO!r} must be [batch, 1] or [batch, <= seq] (TRL's), got {got}")
    if value.shape[1] == 1 or value.shape[1] == shape[1]:
        return value.to(dtype)
    if value.shape[1] > shape[1]:
        raise ConfigError(f"batch field {IS_RATIO!r} is wider ({value.shape[1]}) than the tokens ({shape[1]})")
    ones = torch.ones(shape[0], shape[1] - value.shape[1], dtype=dtype, device=value.device)
    return torch.cat([ones, value.to(dtype)], dim=1)  # right-aligned to the completion, like the log-probs


def gamma_weights(
    adv: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, is_ratio: torch.Tensor | None, s: TrlSettings
) -> torch.Tensor:
    """TRL's VESPO weights phi(w) (detached) from the sequence's summed log-ratio (plus the rollout correction's)."""
    with torch.no_grad():
        seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=-1, keepdim=True)
        if is_ratio is not None:
            log_is = torch.clamp(torch.log(is_ratio), VESPO_LOWER, 20.0)
            seq = seq + (log_is * mask if log_is.shape == mask.shape else log_is).sum(dim=-1, keepdim=True)
        log_w = seq.clamp(VESPO_LOWER, 20.0)
        nonneg = adv >= 0
        k = torch.where(nonneg, s.vespo_k_pos, s.vespo_k_neg)
        lam = torch.where(nonneg, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _per_token_loss(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    is_ratio: torch.Tensor | None,
    cfg: LossConfig,
    s: TrlSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token policy loss before the off-policy mask, the importance weight coef_1), as TRL forms them."""
    log_ratio = lp - old
    if cfg.log_ratio_clip is not None:
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clip, cfg.log_ratio_clip)
    if s.importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    if s.loss_type == "cispo":
        return -torch.clamp(coef_1, max=cfg.clip_eps_high).detach() * adv * lp, coef_1
    if s.loss_type == "sapo":
        temperatures = torch.where(adv > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        return -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * adv, coef_1
    if s.loss_type == "vespo":
        return -gamma_weights(adv, log_ratio, mask, is_ratio, s) * adv * lp, coef_1
    coef_2 = torch.clamp(coef_1, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    capped = torch.clamp(coef_1, max=s.delta) if s.delta is not None else coef_1
    return -torch.min(capped * adv, coef_2 * adv), coef_1


def _aggregate(
    values: torch.Tensor, mask: torch.Tensor, s: TrlSettings, num_items: torch.Tensor | None
) -> torch.Tensor:
    """One micro-batch's loss from its per-token losses, with TRL's normaliser for the loss type."""
    ga = s.gradient_accumulation_steps
    if s.loss_type in ("grpo", "sapo"):
        return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    if s.loss_type == "bnpo":
        return (values * mask).sum() / mask.sum().clamp(min=1.0) / ga
    if s.loss_type == "dr_grpo":
        return (values * mask).sum() / (values.size(0) * s.max_completion_length) / ga
    if s.loss_type == "luspo":
        return (values * mask).sum(-1).mean() / ga
    assert num_items is not None
    normalizer = num_items.clamp(min=1.0) / s.num_processes * ga / s.steps_per_generation
    return (values * mask).sum() / normalizer


def _num_items(batch: Mapping[str, Any], s: TrlSettings) -> torch.Tensor | None:
    if s.loss_type not in NUM_ITEMS_LOSS_TYPES:
        return None
    value = batch.get(NUM_ITEMS)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ConfigError(
            f"batch has no {NUM_ITEMS!r} (a 0-dim tensor: the generation batch's loss tokens over every process), "
            f"needed by TRL's loss_type {s.loss_type}"
        )
    return value.reshape(()).double()


def _micro_batches(batch: Mapping[str, Any], rows: int, s: TrlSettings) -> list[torch.Tensor]:
    index = batch.get(MICRO_BATCH)
    if index is None:
        if s.gradient_accumulation_steps > 1:
            raise ConfigError(
                f"batch has no {MICRO_BATCH!r} index, needed under convention trl with gradient_accumulation_steps "
                f"{s.gradient_accumulation_steps} (each micro-batch is normalised on its own, as TRL's loss is)"
            )
        return [torch.arange(rows)]
    if not isinstance(index, torch.Tensor) or tuple(index.shape) != (rows,):
        raise ConfigError(f"batch field {MICRO_BATCH!r} must be [batch] (one index per row)")
    return [(index == m).nonzero().flatten() for m in torch.unique(index).tolist()]


def trl_policy_loss(
    logprobs: torch.Tensor,
    batch: Mapping[str, Any],
    cfg: LossConfig,
    advantages: torch.Tensor,
    entropy: torch.Tensor | None,
) -> TrlLoss:
    """TRL 1.16's `_compute_loss` (less the router loss) summed over the batch's micro-batches; `advantages` [B, T]."""
    s = cfg.trl or TrlSettings()
    on = batch["loss_mask"] > 0
    dtype = logprobs.dtype
    mask = on.to(dtype)
    lp = masked(logprobs, on)
    recorded_old = batch.get("old_logprobs")
    old = lp.detach() if recorded_old is None else masked(recorded_old.to(dtype), on)
    adv = masked(advantages.to(dtype), on)
    correction = trl_rollout_correction(cfg)
    is_ratio = None
    if correction is not None:
        is_ratio = _recorded_ratio(batch, lp.shape, dtype) if correction.recorded else None
        if is_ratio is None:
            if "rollout_logprobs" not in batch:
                raise ConfigError("batch has no 'rollout_logprobs', needed for TRL's rollout correction")
            rollout = masked(batch["rollout_logprobs"].to(dtype), on)
            is_ratio = rollout_correction_ratio(old, rollout, mask, correction.mode, correction.low, correction.high)
    num_items = _num_items(batch, s)
    ref = masked(batch["ref_logprobs"].to(dtype), on) if cfg.kl_coef else None
    sampling = masked(batch["rollout_logprobs"].to(dtype), on) if "rollout_logprobs" in batch else old

    per_token_parts, pg_total, loss_total = [], lp.new_zeros(()), lp.new_zeros(())
    clipped, kl_sum = 0.0, 0.0
    rows_of = _micro_batches(batch, lp.shape[0], s)
    for rows in rows_of:
        m_lp, m_old, m_adv, m_mask = lp[rows], old[rows], adv[rows], mask[rows]
        m_ratio = None if is_ratio is None else is_ratio[rows]
        ptl, coef_1 = _per_token_loss(m_lp, m_old, m_adv, m_mask, m_ratio, cfg, s)
        if s.off_policy_mask_threshold is not None:
            kl_div = torch.nan_to_num(sampling[rows] - m_lp.detach(), nan=0.0)
            avg = (kl_div * m_mask).sum(1, keepdim=True) / m_mask.sum(1, keepdim=True).clamp(min=1.0)
            ptl = ptl * ((m_adv >= 0) | (avg <= s.off_policy_mask_threshold)).to(dtype)
        if m_ratio is not None and s.loss_type != "vespo":
            ptl = ptl * m_ratio
        if ref is not None:
            m_ref = ref[rows]
            kl = torch.exp(m_ref - m_lp) - (m_ref - m_lp) - 1
            if s.use_bias_correction_kl:
                kl = kl * coef_1
            ptl = ptl + cfg.kl_coef * kl
            kl_sum += float((kl.detach() * m_mask).sum())
        pg = _aggregate(ptl, m_mask, s, num_items)
        loss = pg
        if cfg.entropy_coef:
            if entropy is None:
                raise ConfigError("entropy_coef is set but no entropy was computed")
            ent = masked(entropy[rows], on[rows])
            loss = (
                loss
                - cfg.entropy_coef * (ent * m_mask).sum() / m_mask.sum().clamp(min=1.0) / s.gradient_accumulation_steps
            )
        pg_total, loss_total = pg_total + pg, loss_total + loss
        per_token_parts.append((rows, masked(ptl.detach().expand_as(m_mask), m_mask > 0)))
        with torch.no_grad():
            low = (coef_1 < 1 - cfg.clip_eps_low) & (m_adv < 0)
            high = (coef_1 > 1 + cfg.clip_eps_high) & (m_adv > 0)
            clipped += float(((low | high).expand_as(m_mask) * m_mask).sum())
    per_token = torch.zeros_like(lp, requires_grad=False)
    for rows, values in per_token_parts:
        per_token[rows] = values
    tokens = float(mask.sum())
    metrics = {"clip_fraction": clipped / max(tokens, 1.0), "kl": kl_sum / max(tokens, 1.0)}
    return TrlLoss(loss=loss_total, pg_loss=pg_total, per_token=per_token, metrics=metrics)
