"""The GRPO/PPO policy loss the reference trainer trains with and the replay engine recomputes.

One implementation serves both, so a replay with no mitigation is bit-identical to training.
Every knob defaults to "off"; the mitigations are knobs set only for a replay.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from axrl_spike_replay.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOGPROB_BASES = ("old", "rollout")


@dataclass(frozen=True)
class RatioOutlierMask:
    """Mask tokens (or whole sequences, by the geometric mean) whose importance ratio leaves [low, high]."""

    level: str = "token"  # token | sequence
    low: float = 0.5
    high: float = 2.0
    base: str = "rollout"  # rollout | old: logprobs the current policy's ratio is taken against

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence"):
            raise ConfigError(f"ratio_outlier_mask.level must be 'token' or 'sequence', got {self.level!r}")
        if self.base not in LOGPROB_BASES:
            raise ConfigError(f"ratio_outlier_mask.base must be one of {LOGPROB_BASES}, got {self.base!r}")
        if not 0 <= self.low < self.high:
            raise ConfigError(f"ratio_outlier_mask needs 0 <= low < high, got low={self.low}, high={self.high}")


@dataclass(frozen=True)
class LossConfig:
    """Loss knobs from `run_config.yaml`'s `loss:` section, plus replay-only mitigations."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    is_base_logprobs: str = "old"
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    # replay-only mitigations (off by default)
    mismatch_token_clip_max: float | None = None
    advantage_clip: float | None = None
    log_ratio_clip: float | None = None
    ratio_outlier_mask: RatioOutlierMask | None = None
    balance_negative_advantages: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ConfigError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.is_base_logprobs not in LOGPROB_BASES:
            raise ConfigError(f"is_base_logprobs must be one of {LOGPROB_BASES}, got {self.is_base_logprobs!r}")
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "entropy_coef", "aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("mismatch_token_clip_max", "advantage_clip", "log_ratio_clip"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ConfigError(f"dual_clip_c must be > 1, got {self.dual_clip_c!r}")

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.pop("extra")
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any], section: str = "loss") -> LossConfig:
        """Build from a mapping; unknown keys are an error that names them and lists the known ones."""
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"{section}: unknown keys {unknown} (known: {sorted(known)})")
        values = dict(doc)
        mask = values.get("ratio_outlier_mask")
        if isinstance(mask, dict):
            values["ratio_outlier_mask"] = RatioOutlierMask(**mask)
        return cls(**values)


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
