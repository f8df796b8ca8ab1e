"""TRL's `GRPOConfig` as a run config's `loss:` section (convention trl), as `GRPOTrainer._compute_loss` reads it.

- `epsilon`, `epsilon_high` (else `epsilon`) -> `clip_eps_low`, `clip_eps_high`;
- `beta` -> `kl_coef` (TRL's k3, unclamped); `entropy_coef` (static) -> `entropy_coef`;
- the trainer's resolved `router_aux_loss_coef`, when its aux loss is on (else 0) -> `aux_loss_coef`;
- `loss_type`, `importance_sampling_level`, `delta`, `sapo_*`, `vespo_*`, `off_policy_mask_threshold`,
  `use_bias_correction_kl`, `max_completion_length`, `steps_per_generation` -> `trl.<the same name>`;
- `vllm_importance_sampling_mode` / `_clip_min` / `_clip_max`, when TRL applied the correction (`use_vllm` and
  `vllm_importance_sampling_correction`) -> `trl.rollout_correction` / `_min` / `_max`;
- the step's `current_gradient_accumulation_steps`, the accelerator's `num_processes`, TRL's version ->
  `trl.gradient_accumulation_steps`, `trl.num_processes`, `trl.version`.

A setting that shapes TRL's loss and that the convention does not reproduce (`trl_settings.UNCOVERED_SETTINGS`) is
listed under `unreproduced`, which a replay refuses naming it (`LossConfig.from_dict`), never dropped.
"""

from __future__ import annotations

from typing import Any

from axrl_spike_replay.training.loss_config import UNREPRODUCED_KEY, LossConfig
from axrl_spike_replay.training.trl_settings import UNCOVERED_SETTINGS

_SAME_NAMES = (
    "loss_type",
    "importance_sampling_level",
    "delta",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "off_policy_mask_threshold",
    "use_bias_correction_kl",
    "max_completion_length",
    "steps_per_generation",
)


def trl_loss_section(
    args: Any,
    *,
    gradient_accumulation_steps: int,
    num_processes: int,
    aux_loss_coef: float,
    version: str,
    use_vllm: bool | None = None,
) -> dict[str, Any]:
    """The `loss:` section for a `GRPOConfig` `args` (read by attribute), the step's accumulation count, the
    process count, the trainer's resolved router-loss coefficient (0 when its aux loss is off) and TRL's version.
    Settings the convention does not reproduce are listed under `unreproduced`."""
    trl: dict[str, Any] = {name: getattr(args, name) for name in _SAME_NAMES}
    trl["max_completion_length"] = int(trl["max_completion_length"])
    trl["steps_per_generation"] = int(trl["steps_per_generation"] or gradient_accumulation_steps)
    vllm = args.use_vllm if use_vllm is None else use_vllm
    corrected = bool(vllm and args.vllm_importance_sampling_correction)
    trl["rollout_correction"] = args.vllm_importance_sampling_mode if corrected else None
    trl["rollout_correction_min"] = args.vllm_importance_sampling_clip_min
    trl["rollout_correction_max"] = args.vllm_importance_sampling_clip_max
    trl.update(gradient_accumulation_steps=int(gradient_accumulation_steps), num_processes=int(num_processes))
    trl["version"] = version
    high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    section: dict[str, Any] = {
        "convention": "trl",
        "clip_eps_low": float(args.epsilon),
        "clip_eps_high": float(high),
        "kl_coef": float(args.beta),
        "entropy_coef": float(args.entropy_coef),
        "aux_loss_coef": float(aux_loss_coef),
        "trl": trl,
    }
    unreproduced = [
        f"{name}={getattr(args, name)!r}: {what}"
        for name, (differs, what) in UNCOVERED_SETTINGS.items()
        if differs(getattr(args, name))
    ]
    if unreproduced:
        section[UNREPRODUCED_KEY] = unreproduced
    return section


def trl_loss_config(section: dict[str, Any]) -> LossConfig:
    """The LossConfig a section describes (ConfigError naming what it cannot be, `unreproduced` included)."""
    return LossConfig.from_dict(section)
