"""TRL 1.16's own loss knobs (`GRPOConfig`), as `loss.convention: trl` reads them from `run_config.yaml`'s
`loss.trl:` section. Torch-free: the mitigation registry validates configs through `LossConfig`; the math is in
`training/trl_convention.py`.

TRL's knobs that `LossConfig` already has keep our names there: `epsilon` -> `clip_eps_low`, `epsilon_high` ->
`clip_eps_high`, `beta` -> `kl_coef` (TRL's k3, unclamped), `entropy_coef` -> `entropy_coef`,
`router_aux_loss_coef` -> `aux_loss_coef`. Everything else TRL's `_compute_loss` reads is here, under TRL's own
name where it has one (`rollout_correction*` are TRL's `vllm_importance_sampling_*`, which TRL applies only when
it generates with vLLM; `num_processes` is its accelerator's).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError

TRL_VERSION = "1.16.0"  # the TRL release whose GRPOTrainer loss the trl convention reproduces
TRL_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
TRL_IS_LEVELS = ("token", "sequence")
ROLLOUT_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# loss types whose normaliser is TRL's `num_items_in_batch` (the generation batch's loss tokens, all processes)
NUM_ITEMS_LOSS_TYPES = ("cispo", "dapo", "vespo")
# GRPOConfig fields the convention reads (beside the ones LossConfig holds under our names) and the ones that shape
# the loss the convention does not reproduce, each with what happens instead: a capture refuses to write them as
# covered (they land in `loss.unreproduced`), a replay refuses them naming the setting.
UNCOVERED_SETTINGS = {
    "top_entropy_quantile": (lambda v: v != 1.0, "its high-entropy token mask"),
    "use_adaptive_entropy": (lambda v: bool(v), "its adaptive entropy coefficient (state of the run)"),
    "num_iterations": (lambda v: v != 1, "more than one update per generation (old logprobs re-scored)"),
}


@dataclass(frozen=True)
class TrlSettings:
    """TRL's `GRPOConfig` loss settings the `trl` convention reproduces (TRL 1.16's defaults)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    delta: float | None = None  # two-sided clipping: the ratio capped at delta on negative advantages' side
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    rollout_correction: str | None = None  # vllm_importance_sampling_mode, when TRL applied the correction
    rollout_correction_min: float | None = None  # vllm_importance_sampling_clip_min
    rollout_correction_max: float | None = 3.0  # vllm_importance_sampling_clip_max
    # the ratio TRL's loss consumed is in the batch (the trainer's own correction); False when a mitigation set the
    # correction, whose ratio the replay computes from old vs rollout log-probs as TRL's generation step does
    rollout_correction_recorded: bool = True
    max_completion_length: int = 512  # dr_grpo's constant normaliser
    gradient_accumulation_steps: int = 1  # the step's micro-batches per process (TRL's current_gradient_...)
    steps_per_generation: int = 1
    num_processes: int = 1
    version: str = TRL_VERSION  # the TRL release the snapshot was captured with

    def __post_init__(self) -> None:
        if self.loss_type not in TRL_LOSS_TYPES:
            raise ConfigError(f"loss.trl.loss_type must be one of {TRL_LOSS_TYPES}, got {shown(self.loss_type, 60)}")
        if self.importance_sampling_level not in TRL_IS_LEVELS:
            raise ConfigError(
                f"loss.trl.importance_sampling_level must be one of {TRL_IS_LEVELS}, "
                f"got {shown(self.importance_sampling_level, 60)}"
            )
        if self.rollout_correction is not None and self.rollout_correction not in ROLLOUT_CORRECTION_MODES:
            raise ConfigError(
                f"loss.trl.rollout_correction must be one of {ROLLOUT_CORRECTION_MODES} or null, "
                f"got {shown(self.rollout_correction, 60)}"
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            _positive(name, getattr(self, name))
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _number(name, getattr(self, name))
        for name in ("delta", "rollout_correction_min", "rollout_correction_max"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.off_policy_mask_threshold is not None:
            _number("off_policy_mask_threshold", self.off_policy_mask_threshold)
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ConfigError(
                f"loss.trl.use_bias_correction_kl must be true or false, got {shown(self.use_bias_correction_kl, 60)}"
            )
        for name in ("max_completion_length", "gradient_accumulation_steps", "steps_per_generation", "num_processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"loss.trl.{name} must be an integer >= 1, got {shown(value, 60)}")
        if not isinstance(self.version, str):
            raise ConfigError(f"loss.trl.version must be a string, got {shown(self.version, 60)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Any) -> TrlSettings:
        """From `loss.trl:`; unknown keys are an error naming them (a GRPOConfig setting the convention does not read
        is refused, never ignored)."""
        if not isinstance(doc, dict):
            raise ConfigError(f"loss.trl must be a mapping of TRL's GRPOConfig settings, got {type(doc).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(
                f"loss.trl: settings {shown_names(unknown)} are not ones the trl convention reproduces "
                f"(known: {sorted(known)}); replay this snapshot with the trainer's own code (--backend command)"
            )
        return cls(**doc)

    def version_note(self) -> str | None:
        """A line naming the captured TRL release when it is not the one the convention was checked against."""
        if self.version == TRL_VERSION:
            return None
        return (
            f"the snapshot was captured with TRL {shown(self.version, 40, quote=False)}; the trl convention "
            f"reproduces TRL {TRL_VERSION}'s loss (checked against its code), so a difference between the releases' "
            "GRPOTrainer._compute_loss is not reproduced"
        )


def _number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"loss.trl.{name} must be a finite number, got {shown(value, 60)}")


def _positive(name: str, value: Any) -> None:
    _number(name, value)
    if not value > 0:
        raise ConfigError(f"loss.trl.{name} must be a number > 0, got {shown(value, 60)}")
