"""The loss settings of a run (`run_config.yaml`'s `loss:` section plus the replay-only knobs). Torch-free: the
mitigation registry and the server read them without loading the training math (`policy_loss`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

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
