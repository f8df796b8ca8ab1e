"""Where a mitigation lives in the trainers' own configuration: what to change in training once a replay proved it.

Each mitigation declares its settings in its one declaration (`experiment.mitigation.mitigations.MITIGATIONS`, field
`settings`), one `TrainerSetting` per trainer that has one, and one with `setting=None` and a note where the
trainer has none (a patch, or a replay-only diagnostic). The trainers:

- `axrl`: this tool's `run_config.yaml` (`loss:` and `routing:` keys), what the reference trainer reads and what
  a trainer writing snapshot format v1 records; the replay reads the same keys, so a setting here is exactly the
  replayed change;
- `verl`: verl 0.9.1's Hydra config keys, checked against its shipped `verl/trainer/config/_generated_ppo_*.yaml`
  (tests/replay/test_trainer_settings.py); the actor's loss knobs under `actor_rollout_ref.actor`, the rollout
  correction under `algorithm.rollout_correction`, the Megatron engine's model knobs under
  `actor_rollout_ref.actor.megatron.override_transformer_config` (Megatron-core `TransformerConfig` fields);
- `trl`: TRL 1.16's `GRPOConfig` fields (and the policy's transformers config for its router loss), as the trl
  convention reads them back from a TRL snapshot's `loss.trl` (capture/trl_loss_section.py);
- `megatron`: Megatron-LM's command-line flags, only where a well-known flag exists (the MoE router's losses and
  routing replay; Megatron-LM has no RL loss of its own).

Which trainer wrote a snapshot is read from its run config: `loss.convention: verl` is verl (the verl hook writes
it), `trl` TRL (its callback writes it), anything else this tool's own convention (`snapshot_trainer`). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError

TRAINERS: dict[str, str] = {  # key -> how people name it
    "axrl": "run_config.yaml (this tool's convention)",
    "verl": "verl 0.9.1",
    "trl": "TRL 1.16 GRPOConfig",
    "megatron": "Megatron-LM",
}
# What a trainer's settings are, for the sentence that introduces them.
SETTING_KINDS: dict[str, str] = {
    "axrl": "run_config.yaml keys (`loss:`, `routing:`), as the reference trainer and the replay read them",
    "verl": "Hydra overrides of verl's trainer config",
    "trl": "fields of TRL's GRPOConfig",
    "megatron": "Megatron-LM command-line flags",
}


@dataclass(frozen=True)
class TrainerSetting:
    """One trainer's setting for a mitigation: `setting(value)` gives the setting for the mitigation's normal-form
    value (None: this trainer has no setting for that value); `note` says when it applies or what to do instead."""

    trainer: str  # a TRAINERS key
    setting: Callable[[Any], str | None]
    note: str = ""


def none(trainer: str, note: str) -> TrainerSetting:
    """`trainer` has no setting for this mitigation; `note` says what to do instead."""
    return TrainerSetting(trainer, lambda value: None, note)


# Megatron-LM trains the model; the RL loss lives in the trainer on top of it (verl, this tool's convention, ...).
NO_MEGATRON_FLAG = none("megatron", "no flag: Megatron-LM has no RL loss; set it in the RL trainer on top")
NO_TRL_ROUTING = none("trl", "no setting: TRL 1.16 has no routing replay (transformers generation returns no routes)")


def scalar(value: Any) -> str:
    """A normal-form value as a config or flag takes it: 2 (a whole float), 0.5, true/false, 0,1 (a list)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if math.isfinite(value) and value.is_integer() else repr(value)
    if isinstance(value, (list, tuple)):
        return ",".join(scalar(v) for v in value)
    return str(value)


def flow(value: Any) -> str:
    """A value as YAML on one line (`{level: token, low: 0.5}`, `[0, 1]`, `2.0`)."""
    import yaml

    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()
    return text.removesuffix("\n...").strip()


def run_config_key(key: str) -> TrainerSetting:
    """The `axrl` setting `key: <value>` of run_config.yaml (`key` dotted: `loss.dual_clip_c`)."""
    return TrainerSetting("axrl", lambda value: f"{key}: {flow(value)}")


def override(template: str, note: str = "", trainer: str = "verl") -> TrainerSetting:
    """A setting whose text is `template` with `{value}` filled in (a verl override, a Megatron flag)."""
    return TrainerSetting(trainer, lambda value: template.format(value=scalar(value)), note)


def per_value(trainer: str, settings: Mapping[Any, str | None], note: str = "") -> TrainerSetting:
    """A setting that depends on which value is chosen (None: no setting for that value)."""
    return TrainerSetting(trainer, lambda value: settings.get(value), note)


def trainer_of(run_config: Any) -> str:
    """The trainer that wrote a run config: `verl` or `trl` for that `loss.convention`, else `axrl`."""
    loss = run_config.get("loss") if isinstance(run_config, Mapping) else None
    convention = loss.get("convention") if isinstance(loss, Mapping) else None
    return convention if convention in ("verl", "trl") else "axrl"


def snapshot_trainer(snapshot: str | Path | None) -> str | None:
    """The trainer that wrote the snapshot at `snapshot` (from its run_config.yaml), None when it cannot be read."""
    from axrl_spike_replay.snapshot.layout import RUN_CONFIG
    from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

    if not snapshot:
        return None
    path = Path(str(snapshot)) / RUN_CONFIG
    try:
        return trainer_of(read_untrusted_yaml(path, "run config", within=path.parent)) if path.is_file() else None
    except (AxrlError, OSError):
        return None


def verl_rejection(value: Any) -> str | None:
    """`ratio_outlier_mask` as verl's rejection sampling, mapped as the verl convention maps it in a replay
    (`training.verl_settings.rejection_options`): our bounds on pi/pi_rollout become verl's k1 bounds on
    pi_rollout/pi_old. None when verl cannot express it (base old; an unbounded side, low 0)."""
    from axrl_spike_replay.training.loss_config import LossConfig, RatioOutlierMask, rejection_options
    from axrl_spike_replay.training.verl_settings import bounds_spec

    mask = RatioOutlierMask(**value) if isinstance(value, Mapping) else RatioOutlierMask()
    if mask.base != "rollout":
        return None
    [option] = rejection_options(LossConfig(ratio_outlier_mask=mask))
    if option.lower is None or not math.isfinite(option.upper):
        return None
    return (
        f"algorithm.rollout_correction.rollout_rs={option.option} "
        f"algorithm.rollout_correction.rollout_rs_threshold={bounds_spec(option.lower, option.upper)}"
    )


def verl_kl(value: Any) -> str:
    """`kl_coef` as verl's actor KL loss: on with the coefficient, or off at 0."""
    actor = "actor_rollout_ref.actor"
    return f"{actor}.use_kl_loss=true {actor}.kl_loss_coef={scalar(value)}" if value else f"{actor}.use_kl_loss=false"
