"""verl 0.9.1's actor loss, as `verl.workers.utils.losses.ppo_loss` computes it with the vanilla policy loss.

`compute_policy_loss_vanilla` (log-ratio clamped to +-20 before exp, PPO clip, dual clip with
`clip_ratio_c`, default 3, on negative advantages), `agg_loss` for every `loss_agg_mode` with the
step's global counts (`batch_num_tokens`, `global_batch_size`, `dp_size`), the entropy term, the KL
loss by `kl_penalty` (k1, k2, k3/low_var_kl clamped at 10, `+` straight-through variants), and the
rollout correction of `rollout_corr_helper` (token/sequence truncated IS, IcePop, rejection sampling
with its k1 bounds on pi_rollout/pi_train), computed from old vs rollout logprobs as verl does. A batch that
carries verl's own `rollout_is_weights` (its driver computed them before the update, decoupled mode: the
mini-batch the verl hook saves) has them applied as recorded, as `ppo_loss` does, unless the config names an IS
correction of its own (`rollout_is`, or the mitigation `mismatch_token_clip_max`), which then takes their place.

Our batches hold prompt + response columns; every quantity is per token on the loss mask, so the only
place the layout shows is `seq-mean-token-sum-norm`'s horizon: verl's response width, here the columns
from the first loss column on (or `loss_scale_factor`). Non-finite values at masked positions are
replaced before any arithmetic (`torch.where`), so they reach neither the loss nor the gradient.
Checked against verl's own functions in tests/training/test_verl_crosscheck.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.snapshot.fields import ROLLOUT_IS_WEIGHTS
from axrl_spike_replay.training.loss_config import LossConfig, rejection_options, rollout_is_setting
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.policy_objectives import ObjectiveTerms, objective_aggregation, objective_loss
from axrl_spike_replay.training.verl_settings import VERL_DUAL_CLIP_C, RejectionOption

SAFETY_BOUND = 20.0  # verl clamps log-ratios to +-20 before exp (ppo ratio, k3, rollout correction)
KL_CLAMP = 10.0  # verl clamps the k3 / low_var_kl estimate to +-10


@dataclass
class VerlLoss:
    loss: torch.Tensor  # pg - entropy_coeff * entropy + kl_coef * kl, as ppo_loss returns it
    pg_loss: torch.Tensor
    per_token: torch.Tensor  # [B, T] pg losses (with IS weights), 0 off the mask
    mask: torch.Tensor  # [B, T] bool mask the loss used (after rejection sampling)
    metrics: dict[str, float]


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` on the mask, 0 elsewhere (a NaN or inf off the mask never reaches an arithmetic op)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def response_horizon(mask: torch.Tensor, batch: Mapping[str, Any] | None = None) -> int:
    """verl's `loss_mask.shape[-1]`: the response width the batch was read with (`response_width`, set when
    its per-token fields were verl's `[B, R]`), else the columns from the first one any sequence's loss starts at."""
    width = (batch or {}).get("response_width")
    if isinstance(width, torch.Tensor) and width.dim() == 0 and 0 < int(width) <= mask.shape[-1]:
        return int(width)
    columns = mask.any(dim=0).nonzero()
    return int(mask.shape[-1] - columns[0, 0]) if columns.numel() else int(mask.shape[-1])


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    counts: GlobalCounts | None,
    horizon: float,
) -> torch.Tensor:
    """verl's `agg_loss`: with `counts` the global normalisation (times dp_size), without it the rank's own."""
    dp = counts.dp_size if counts is not None else 1
    values = masked(loss_mat, mask)
    # A zero count comes with a zero sum: verl's 0/0 NaN becomes 0 (any other count gives verl's value).
    if mode == "token-mean":
        tokens = max(counts.batch_num_tokens, 1.0) if counts is not None else mask.sum().clamp(min=1)
        return values.sum() / tokens * dp
    if mode == "token-sum":
        return values.sum() * dp
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        seq_tokens = mask.sum(dim=-1)
        seq_losses = values.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (seq_tokens + 1e-8)
        seq_mask = seq_tokens > 0  # fully masked sequences are left out
        sequences = max(counts.global_batch_size, 1.0) if counts is not None else seq_mask.sum().clamp(min=1)
        loss = masked(seq_losses, seq_mask).sum() / sequences * dp
        if mode == "seq-mean-token-sum-norm":
            loss = loss / horizon
        return loss
    raise ConfigError(f"loss_agg_mode {shown(mode, 60)} is not one of verl's")


def kl_penalty(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str, clamp: float | None = None
) -> torch.Tensor:
    """verl's `kl_penalty`: the forward estimate, with a k2 gradient for the `+` variants. `clamp` (the replay's
    `kl_clamp`) replaces verl's +-10 on k3 / low_var_kl and bounds the other estimates alike."""
    base = estimator[:-1] if estimator.endswith("+") else estimator
    if base in ("kl", "k1"):
        forward = logprob - ref_logprob
    elif base == "abs":
        forward = (logprob - ref_logprob).abs()
    elif base in ("mse", "k2"):
        forward = 0.5 * (logprob - ref_logprob).square()
    elif base in ("low_var_kl", "k3"):
        kl = (ref_logprob - logprob).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        bound = KL_CLAMP if clamp is None else clamp
        forward = (kl.exp() - kl - 1).clamp(-bound, bound)
    else:
        raise ConfigError(f"kl_estimator {shown(estimator, 60)} is not one of verl's")
    if clamp is not None and base not in ("low_var_kl", "k3"):
        forward = forward.clamp(-clamp, clamp)
    if not estimator.endswith("+") or estimator in ("mse", "k2"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, upper: float, lower: float | None):
    """verl's truncated IS weights pi_train/pi_rollout (detached), 0 off the mask; IcePop zeroes out of bounds."""
    if level == "token":
        raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    else:
        total = masked(log_ratio, mask).sum(dim=-1, keepdim=True)
        raw = total.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio)
    raw = masked(raw, mask)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    return weights.detach()


def recorded_is_weights(batch: Mapping[str, Any], mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The IS weights verl's driver put on the mini-batch (`rollout_is_weights`), 0 off the mask, no gradient;
    None when the batch has none."""
    value = batch.get(ROLLOUT_IS_WEIGHTS)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.shape != mask.shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(
            f"batch field {ROLLOUT_IS_WEIGHTS!r} must be shaped like the loss mask {tuple(mask.shape)}, got {got}"
        )
    return masked(value.to(dtype), mask).detach()


def _sequence_stat(values: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    if how == "sum":
        return masked(values, mask).sum(dim=-1)
    if how == "mean":
        return masked(values, mask).sum(dim=-1) / (mask.sum(dim=-1) + 1e-8)
    peak = values.masked_fill(~mask, -math.inf).max(dim=-1).values
    return torch.where(peak == -math.inf, torch.zeros_like(peak), peak)


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, options: list[RejectionOption]) -> torch.Tensor:
    """verl's rejection sampling: the loss mask with every token (or sequence) failing any option removed.

    k1 = log(pi_rollout/pi_train) is kept within [log lower, log upper]; k2, k3 (and their sequence sums,
    means and maxima) under the upper bound.
    """
    if log_ratio.shape[0] == 0:
        return mask
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -safe, "k2": 0.5 * safe**2, "k3": safe.exp() - 1.0 - safe}
    keep = torch.ones_like(mask)
    for opt in options:
        scope, _, estimator = opt.option.rpartition("_")
        stat = stats[estimator]
        if scope != "token":
            stat = _sequence_stat(stat, mask, scope.removeprefix("seq_"))[:, None]
        if estimator == "k1":
            assert opt.lower is not None
            upper_log = math.log(opt.upper) if opt.upper != math.inf else math.inf
            ok = (stat >= math.log(opt.lower)) & (stat <= upper_log)
        else:
            ok = stat <= opt.upper
        keep = keep & ok.expand_as(mask)
    return mask & keep


def verl_policy_loss(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    cfg: LossConfig,
    advantages: torch.Tensor,
    entropy: torch.Tensor | None,
    counts: GlobalCounts | None,
) -> VerlLoss:
    """verl 0.9.1's `ppo_loss` (vanilla policy loss) on one rank's batch; `advantages` are [B, T] as given."""
    mask = batch["loss_mask"] > 0
    dtype = logprobs.dtype
    logprobs = masked(logprobs, mask)
    old = masked(batch["old_logprobs"].to(dtype), mask)
    adv = masked(advantages.to(dtype), mask)
    horizon = float(cfg.loss_scale_factor) if cfg.loss_scale_factor is not None else response_horizon(mask, batch)

    weights = None
    is_setting, rs = rollout_is_setting(cfg), rejection_options(cfg)
    if is_setting is not None or rs:
        rollout = masked(batch["rollout_logprobs"].to(dtype), mask)
        correction_ratio = old - rollout  # log(pi_train / pi_rollout), verl's decoupled mode
        if is_setting is not None:
            weights = rollout_is_weights(correction_ratio, mask, *is_setting)
        if rs:
            mask = rejection_mask(correction_ratio, mask, rs)
    if weights is None:
        weights = recorded_is_weights(batch, mask, dtype)

    neg_kl = (logprobs - old).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if cfg.log_ratio_clip is not None:
        neg_kl = neg_kl.clamp(-cfg.log_ratio_clip, cfg.log_ratio_clip)
    c = cfg.dual_clip_c if cfg.dual_clip_c is not None else VERL_DUAL_CLIP_C
    objective = _objective(logprobs, old, adv, mask, cfg)
    if objective is None:
        ratio = neg_kl.exp()
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
        clipped = torch.maximum(pg1, pg2)
        dual = torch.min(-adv * c, clipped)
        pg = torch.where(adv < 0, dual, clipped)
        clip_hit, lower_hit = pg2 > pg1, (clipped > -adv * c) & (adv < 0)
    else:
        pg, clip_hit, lower_hit = objective.per_token, objective.clipped, torch.zeros_like(mask)
    if weights is not None:
        pg = pg * weights
    pg_loss = agg_loss(pg, mask, _pg_aggregation(cfg), counts, horizon)
    loss = pg_loss
    metrics: dict[str, float] = {}
    if cfg.entropy_coef:
        if entropy is None:
            raise ConfigError("entropy_coef is set but no entropy was computed")
        entropy_loss = agg_loss(masked(entropy, mask), mask, cfg.loss_agg_mode, counts, horizon)
        loss = loss - cfg.entropy_coef * entropy_loss
        metrics["entropy_loss"] = float(entropy_loss.detach())
    if cfg.kl_coef:
        ref = masked(batch["ref_logprobs"].to(dtype), mask)
        kl_loss = agg_loss(
            kl_penalty(logprobs, ref, cfg.kl_estimator, cfg.kl_clamp), mask, cfg.loss_agg_mode, counts, horizon
        )
        loss = loss + kl_loss * cfg.kl_coef
        metrics["kl"] = float(kl_loss.detach())
    with torch.no_grad():
        on = mask
        n = on.sum().clamp(min=1)
        metrics.update(
            {
                "pg_clipfrac": float((clip_hit & on).sum() / n),
                "pg_clipfrac_lower": float((lower_hit & on).sum() / n),
                "ppo_kl": float(masked(-neg_kl, on).sum() / n),
                "rejected_tokens": float((batch["loss_mask"] > 0).sum() - on.sum()),
                "mean_is_weight": float(weights[on].mean()) if weights is not None and on.any() else 1.0,
            }
        )
    return VerlLoss(loss=loss, pg_loss=pg_loss, per_token=masked(pg.detach(), mask), mask=mask, metrics=metrics)


def _objective(
    logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> ObjectiveTerms | None:
    """verl's gspo, cispo or sapo policy loss per token (None: the vanilla loss), with verl's clamps."""
    if cfg.policy_loss_mode == "vanilla":
        return None
    log_ratio = logprobs - old
    if cfg.log_ratio_clip is not None:
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clip, cfg.log_ratio_clip)
    return objective_loss(cfg.policy_loss_mode, logprobs, log_ratio, adv, mask.to(logprobs.dtype), cfg, SAFETY_BOUND)


def _pg_aggregation(cfg: LossConfig) -> str:
    return objective_aggregation(cfg.policy_loss_mode, cfg.loss_agg_mode)


def verl_local_counts(batch: dict[str, torch.Tensor], cfg: LossConfig) -> tuple[float, float]:
    """(loss tokens after rejection sampling, sequences) of one rank's batch: its share of the global counts."""
    mask = batch["loss_mask"] > 0
    rs = rejection_options(cfg)
    if rs:
        dtype = torch.promote_types(batch["old_logprobs"].dtype, torch.float32)  # as the loss computes it
        old = masked(batch["old_logprobs"].to(dtype), mask)
        rollout = masked(batch["rollout_logprobs"].to(dtype), mask)
        mask = rejection_mask(old - rollout, mask, rs)
    return float(mask.sum()), float(mask.shape[0])
