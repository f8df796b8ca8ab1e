"""The newer GRPO objectives as replay-only mitigations, on every convention where they have a meaning: GSPO's
sequence-level ratio, CISPO's clipped weights, SAPO's soft gate with its temperatures, DAPO's and Dr. GRPO's
aggregation, two-sided clipping (`delta`) and the rollout correction's modes. Named as TRL 1.16's `GRPOConfig`
names them; declared in `experiment.mitigation.mitigation_table`'s one table.

- convention trl: each is TRL's own setting under `loss.trl` (the trl convention is checked against TRL's
  `_compute_loss` for every value: tests/training/test_trl_crosscheck.py);
- conventions verl and axrl: each is the verl 0.9.1 mechanism that computes the same thing (`loss.policy_loss_mode`
  gspo / cispo / sapo, checked against verl's own losses in tests/training/test_verl_objectives.py;
  `loss_agg_mode`; the dual clip; `rollout_is`), and under axrl the same math without verl's safety clamps. Where
  the two differ, or verl has no such objective (VESPO), the mitigation is refused with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigation_declaration import Advice, Mitigation, ReplaySetup
from axrl_spike_replay.experiment.mitigation.mitigation_values import parse_number
from axrl_spike_replay.experiment.mitigation.trainer_settings import (
    NO_MEGATRON_FLAG,
    TrainerSetting,
    override,
    per_value,
)
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.trl_settings import ROLLOUT_CORRECTION_MODES, TRL_IS_LEVELS, TRL_LOSS_TYPES, TrlSettings
from axrl_spike_replay.training.verl_settings import bounds_spec

ACTOR = "actor_rollout_ref.actor."
VERL_LOSS_MODE = ACTOR + "policy_loss.loss_mode={}"
# a "lower_upper" threshold is quoted: unquoted, YAML (and Hydra, whose numbers allow _) read 0.5_2 as 0.52
VERL_ROLLOUT_IS = "algorithm.rollout_correction.rollout_is={} algorithm.rollout_correction.rollout_is_threshold={}"
# TRL's loss types under the axrl and verl conventions: (policy_loss_mode or None to keep it, loss_agg_mode or None
# to keep it). The aggregations are the nearest of verl's: TRL's dapo normalises by the step's tokens (verl's
# token-mean with normalization global), bnpo by the micro-batch's (per rank), dr_grpo by a constant
# (seq-mean-token-sum-norm), grpo and sapo per sequence, luspo by sequence sums.
AS_VERL: dict[str, tuple[str | None, str | None]] = {
    "grpo": (None, "seq-mean-token-mean"),
    "dapo": (None, "token-mean"),
    "bnpo": (None, "token-mean"),
    "dr_grpo": (None, "seq-mean-token-sum-norm"),
    "luspo": (None, "seq-mean-token-sum"),
    "cispo": ("cispo", None),
    "sapo": ("sapo", "seq-mean-token-mean"),
}
NO_VESPO = "verl 0.9.1 has no VESPO loss and the axrl convention defines none (VESPO's gamma weights are TRL's alone)"


def _on_trl(loss: LossConfig, fields: dict[str, Any]) -> LossConfig:
    return dataclasses.replace(loss, trl=dataclasses.replace(loss.trl or TrlSettings(), **fields))


def _objective(loss: LossConfig, mode: str) -> LossConfig:
    """`loss` with verl's policy loss `mode` in place of the snapshot's; the dual clip (PPO's, read by no other verl
    loss) is dropped when leaving vanilla."""
    if mode == loss.policy_loss_mode:
        return loss
    return dataclasses.replace(loss, policy_loss_mode=mode, dual_clip_c=None if mode != "vanilla" else loss.dual_clip_c)


def refuse_unread_dual_clip(config: Mapping[str, Any], loss: LossConfig) -> None:
    """ConfigError, outside convention trl, for a config asking for two policy objectives (GSPO with cispo or sapo:
    TRL combines them, verl's loss mode is one), or for the dual clip (`dual_clip_c`, `delta`) beside an objective
    that does not read it: switching the objective drops the snapshot's own dual clip, never one the config asks
    for."""
    if loss.convention == "trl":
        return
    if config.get("importance_sampling_level") == "sequence" and config.get("trl_loss_type") in ("cispo", "sapo"):
        raise ConfigError(
            f"mitigations importance_sampling_level=sequence and trl_loss_type={config['trl_loss_type']} have no "
            f"meaning together under convention {loss.convention}: it computes one policy objective (verl's "
            "policy_loss.loss_mode); TRL combines them, verl does not"
        )
    named = [n for n in ("dual_clip_c", "delta") if n in config]
    if named and loss.policy_loss_mode != "vanilla":
        raise ConfigError(
            f"mitigation {named[0]} has no meaning with policy_loss_mode {loss.policy_loss_mode}: it is PPO's dual "
            "clip, which verl's gspo, cispo and sapo losses do not read"
        )


def objective(name: str, on_trl: Callable[[Any], dict[str, Any]], on_verl: Callable[[LossConfig, Any], LossConfig]):
    """Mitigation `name`'s apply: `on_trl(value)` sets `loss.trl` fields under convention trl, `on_verl(loss, value)`
    maps it onto the axrl and verl conventions' own settings (ConfigError where it has no meaning there)."""

    def apply(setup: ReplaySetup, value: Any) -> ReplaySetup:
        loss = setup.loss
        changed = _on_trl(loss, on_trl(value)) if loss.convention == "trl" else on_verl(loss, value)
        return dataclasses.replace(setup, loss=changed)

    return apply


def _sequence_level(loss: LossConfig, value: str) -> LossConfig:
    if value == "sequence":
        return _objective(loss, "gspo")
    return _objective(loss, "vanilla") if loss.policy_loss_mode == "gspo" else loss


def _loss_type(loss: LossConfig, value: str) -> LossConfig:
    if value == "vespo":
        raise ConfigError(
            f"mitigation trl_loss_type=vespo has no meaning under convention {loss.convention}: {NO_VESPO}"
        )
    mode, agg = AS_VERL[value]
    if mode is not None:
        loss = _objective(loss, mode)
    elif loss.policy_loss_mode in ("cispo", "sapo"):  # TRL's other loss types are PPO's clip (GSPO's stays)
        loss = _objective(loss, "vanilla")
    if agg is not None and not (mode == "sapo" and loss.convention == "verl"):  # verl's SAPO aggregates on its own
        loss = dataclasses.replace(loss, loss_agg_mode=agg)
    return loss


def _delta(loss: LossConfig, value: float) -> LossConfig:
    # For A < 0 TRL's loss is |A| max(min(r, delta), clip(r)), the dual clip's |A| min(max(r, clip(r)), c) at
    # c = delta whenever delta >= 1 + epsilon_high; for A > 0 the cap never binds then. Below that they differ.
    if value < 1.0 + loss.clip_eps_high:
        raise ConfigError(
            f"mitigation delta={value:g} has no meaning under convention {loss.convention}: TRL's two-sided clip is "
            f"the dual clip (dual_clip_c) only for delta >= 1 + clip_eps_high = {1.0 + loss.clip_eps_high:g}"
        )
    if loss.policy_loss_mode != "vanilla":
        raise ConfigError(
            f"mitigation delta has no meaning with policy_loss_mode {loss.policy_loss_mode}: it is PPO's dual clip, "
            "which verl's gspo, cispo and sapo losses do not read"
        )
    return dataclasses.replace(loss, dual_clip_c=float(value))


def _split_correction(value: str) -> tuple[str, float | None, float]:
    mode, *caps = value.split(":")
    low, high = (None, float(caps[0])) if len(caps) == 1 else (float(caps[0]), float(caps[1]))
    return mode, low, high


def rollout_correction_threshold(value: str) -> tuple[str, str] | None:
    """TRL's rollout correction `value` as verl's (rollout_is level, rollout_is_threshold), None where verl has no
    such correction: truncation with a lower cap (verl's TIS caps above only), a mask with no lower cap (verl's
    IcePop takes both bounds)."""
    mode, low, high = _split_correction(value)
    level, kind = mode.split("_")
    if kind == "truncate":
        return None if low is not None else (level, f"{high:g}")
    return None if low is None else (level, bounds_spec(low, high))


def _rollout_correction(loss: LossConfig, value: str) -> LossConfig:
    mapped = rollout_correction_threshold(value)
    if mapped is None:
        raise ConfigError(
            f"mitigation rollout_correction={value} has no meaning under convention {loss.convention}: verl's "
            "rollout correction truncates above only (MODE truncate takes MAX alone) and masks between two bounds "
            "(MODE mask takes MIN:MAX)"
        )
    return dataclasses.replace(loss, rollout_is=mapped[0], rollout_is_threshold=mapped[1])


def _sapo_temperatures(loss: LossConfig, value: str) -> LossConfig:
    pos, neg = temperatures(value)
    return dataclasses.replace(loss, sapo_tau_pos=pos, sapo_tau_neg=neg)


def _choice(options: tuple[str, ...]) -> Callable[[str, Any], str]:
    def parse(name: str, raw: Any) -> str:
        if raw not in options:
            raise ConfigError(f"mitigation {name}: must be one of {', '.join(options)}; got {shown(raw)}")
        return str(raw)

    return parse


def _above_one(name: str, raw: Any) -> float:
    value = parse_number(name, raw)  # a number, or its text from the command line
    if not 1 < value < float("inf"):
        raise ConfigError(f"mitigation {name}: must be a number > 1, got {shown(raw)}")
    return value


def parse_temperatures(name: str, raw: Any) -> str:
    """`POS:NEG` (text) or [POS, NEG]: SAPO's gate temperatures for positive and negative advantages, each > 0;
    normal form `POS:NEG` with floats."""
    parts = raw.split(":") if isinstance(raw, str) else raw if isinstance(raw, (list, tuple)) else None
    if parts is None or len(parts) != 2:
        raise ConfigError(f"mitigation {name}: must be POS:NEG (two temperatures > 0), got {shown(raw)}")
    pos, neg = (parse_number(name, p) for p in parts)
    if not (pos > 0 and neg > 0):
        raise ConfigError(f"mitigation {name}: temperatures must be > 0, got {shown(raw)}")
    return f"{pos!r}:{neg!r}"


def temperatures(value: str) -> tuple[float, float]:
    """(positive, negative) of a normal-form `sapo_temperatures` value."""
    pos, neg = value.split(":")
    return float(pos), float(neg)


def parse_rollout_correction(name: str, raw: Any) -> str:
    """`MODE`, `MODE:MAX` or `MODE:MIN:MAX` (TRL's vllm_importance_sampling_mode and its caps; MAX default 3)."""
    parts = str(raw).split(":") if isinstance(raw, str) else []
    if not 1 <= len(parts) <= 3 or parts[0] not in ROLLOUT_CORRECTION_MODES:
        raise ConfigError(
            f"mitigation {name}: must be MODE, MODE:MAX or MODE:MIN:MAX with MODE one of "
            f"{', '.join(ROLLOUT_CORRECTION_MODES)}; got {shown(raw)}"
        )
    try:
        caps = [float(p) for p in parts[1:]]
    except ValueError:
        raise ConfigError(f"mitigation {name}: the caps must be numbers, got {shown(raw)}") from None
    low, high = (None, caps[0]) if len(caps) == 1 else (caps[0], caps[1]) if caps else (None, 3.0)
    if not high > 0 or (low is not None and not 0 < low <= high):
        raise ConfigError(f"mitigation {name}: need 0 < MIN <= MAX, got {shown(raw)}")
    return ":".join([parts[0], *([] if low is None else [repr(low)]), repr(high)])


def rollout_correction_fields(value: str) -> dict[str, Any]:
    """The TrlSettings a normal-form `rollout_correction` value sets (computed from old vs rollout log-probs)."""
    mode, low, high = _split_correction(value)
    return {
        "rollout_correction": mode,
        "rollout_correction_min": low,
        "rollout_correction_max": high,
        "rollout_correction_recorded": False,
    }


def _grpo_config_correction(value: str) -> str:
    mode, low, high = _split_correction(value)
    low_text = "" if low is None else f" vllm_importance_sampling_clip_min={low:g}"
    return f"vllm_importance_sampling_mode={mode}{low_text} vllm_importance_sampling_clip_max={high:g}"


def _verl_correction(value: str) -> str | None:
    mapped = rollout_correction_threshold(value)
    return None if mapped is None else VERL_ROLLOUT_IS.format(mapped[0], mapped[1])


def _run_config_correction(value: str) -> str | None:
    mapped = rollout_correction_threshold(value)
    return None if mapped is None else f"loss.rollout_is: {mapped[0]}, loss.rollout_is_threshold: {mapped[1]}"


def _loss_type_run_config(value: str) -> str | None:
    if value == "vespo":
        return None
    mode, agg = AS_VERL[value]
    keys = ([f"loss.policy_loss_mode: {mode}"] if mode else []) + ([f"loss.loss_agg_mode: {agg}"] if agg else [])
    return ", ".join(keys)


def _setting(trainer: str, text: Callable[[Any], str | None], note: str = "") -> TrainerSetting:
    return TrainerSetting(trainer, text, note)


TRL_NOTE = "loss.trl.{} of a TRL snapshot"

OBJECTIVES: tuple[Mitigation, ...] = (
    Mitigation(
        "importance_sampling_level",
        "loss",
        "token | sequence",
        "GSPO: the importance ratio per sequence (the geometric mean of its tokens' ratios), clipped as one (TRL's "
        "importance_sampling_level; verl's and axrl's policy_loss_mode gspo)",
        _choice(TRL_IS_LEVELS),
        objective("importance_sampling_level", lambda v: {"importance_sampling_level": v}, _sequence_level),
        advice=(
            Advice(
                "policy_drift",
                "`importance_sampling_level: sequence` (GSPO, introduced for MoE stability) — when token ratios "
                "are extreme but each sequence's mean ratio is near 1 (`diagnose` checks it on the stored log-probs).",
            ),
        ),
        caveat="with token-level aggregation (TRL's dapo / bnpo / dr_grpo / cispo, verl's token-mean) long "
        "sequences weigh more, GSPO's own setup averages per sequence; under axrl and verl it replaces PPO's loss, "
        "dual clip included",
        settings=(
            per_value("axrl", {"sequence": "loss.policy_loss_mode: gspo", "token": "loss.policy_loss_mode: vanilla"}),
            per_value("verl", {"sequence": VERL_LOSS_MODE.format("gspo"), "token": VERL_LOSS_MODE.format("vanilla")}),
            override("importance_sampling_level={value}", TRL_NOTE.format("importance_sampling_level"), "trl"),
            NO_MEGATRON_FLAG,
        ),
    ),
    Mitigation(
        "trl_loss_type",
        "loss",
        " | ".join(TRL_LOSS_TYPES),
        "TRL's loss_type: the objective and its aggregation (cispo clips the detached weights, sapo gates softly, "
        "dapo / dr_grpo / bnpo / grpo / luspo normalise differently, vespo gamma-weights); under axrl and verl "
        "verl's loss mode or aggregation of the same effect",
        _choice(TRL_LOSS_TYPES),
        objective("trl_loss_type", lambda v: {"loss_type": v}, _loss_type),
        advice=(
            Advice(
                "policy_drift",
                "`trl_loss_type: cispo` — when a few tokens' ratios dominate (CISPO bounds their weight, keeps their "
                "gradient; `diagnose` measures their share on the stored log-probs); `sapo` for a soft gate.",
            ),
        ),
        caveat="CISPO's cap (its eps_max) is clip_eps_high: TRL caps the weight at epsilon_high (its CISPO setups "
        "set it near 5), verl clips it to [1 - clip_ratio_low, 1 + clip_ratio_high]; another aggregation changes "
        "every step's scale, not only the spike's",
        settings=(
            _setting(
                "axrl", _loss_type_run_config, "vespo has none; dapo's global token count is normalization global"
            ),
            per_value(
                "verl",
                {
                    "cispo": VERL_LOSS_MODE.format("cispo"),
                    "sapo": VERL_LOSS_MODE.format("sapo"),
                    "grpo": ACTOR + "loss_agg_mode=seq-mean-token-mean",
                    "dapo": ACTOR + "loss_agg_mode=token-mean",
                    "bnpo": ACTOR + "loss_agg_mode=token-mean",
                    "dr_grpo": ACTOR + "loss_agg_mode=seq-mean-token-sum-norm",
                    "luspo": ACTOR + "loss_agg_mode=seq-mean-token-sum",
                },
                "verl's loss mode or aggregation of the same effect; verl has no VESPO",
            ),
            override("loss_type={value}", TRL_NOTE.format("loss_type"), "trl"),
            NO_MEGATRON_FLAG,
        ),
    ),
    Mitigation(
        "sapo_temperatures",
        "loss",
        "POS:NEG, each > 0",
        "SAPO's gate temperatures for positive and negative advantages (TRL's sapo_temperature_pos / _neg, verl's "
        "tau_pos / tau_neg; defaults 1.0 and 1.05); read only by the sapo objective",
        parse_temperatures,
        objective(
            "sapo_temperatures",
            lambda v: dict(zip(("sapo_temperature_pos", "sapo_temperature_neg"), temperatures(v), strict=True)),
            _sapo_temperatures,
        ),
        caveat="it changes nothing unless the objective is sapo (trl_loss_type: sapo); a higher temperature makes "
        "the gate sharper, nearer PPO's hard clip",
        settings=(
            _setting("axrl", lambda v: "loss.sapo_tau_pos: {:g}, loss.sapo_tau_neg: {:g}".format(*temperatures(v))),
            _setting("verl", lambda v: "{0}tau_pos={1:g} {0}tau_neg={2:g}".format(ACTOR, *temperatures(v))),
            _setting("trl", lambda v: "sapo_temperature_pos={:g} sapo_temperature_neg={:g}".format(*temperatures(v))),
            NO_MEGATRON_FLAG,
        ),
    ),
    Mitigation(
        "delta",
        "loss",
        "float > 1",
        "two-sided clipping: the importance ratio capped at delta on the unclipped side too (TRL's delta); under "
        "axrl and verl the dual clip at c = delta, the same loss when delta >= 1 + clip_eps_high",
        _above_one,
        objective("delta", lambda v: {"delta": float(v)}, _delta),
        advice=(Advice("negative_advantages", "`delta: 1.5` — TRL's two-sided clip, its form of the dual clip."),),
        caveat="set above 1 + epsilon_high; only ratios beyond delta change",
        settings=(
            override("loss.dual_clip_c: {value}", "the dual clip: TRL's delta when delta >= 1 + clip_eps_high", "axrl"),
            override(ACTOR + "clip_ratio_c={value}", "verl's dual clip: TRL's delta when delta >= 1 + clip_ratio_high"),
            override("delta={value}", TRL_NOTE.format("delta"), "trl"),
            NO_MEGATRON_FLAG,
        ),
    ),
    Mitigation(
        "rollout_correction",
        "loss",
        "MODE | MODE:MAX | MODE:MIN:MAX, MODE one of " + ", ".join(ROLLOUT_CORRECTION_MODES),
        "rollout correction against the generation engine: pi_old/pi_rollout per token or per sequence, truncated "
        "to [MIN, MAX] or masked outside it (MAX default 3; under the axrl and verl conventions a mask takes "
        "MIN:MAX, as verl's does), computed from the stored log-probs (TRL's vllm_importance_sampling_mode; verl's "
        "rollout_is: truncate is its TIS, mask its IcePop)",
        parse_rollout_correction,
        objective("rollout_correction", rollout_correction_fields, _rollout_correction),
        advice=(
            Advice(
                "mismatch",
                "`rollout_correction: sequence_mask:0.5:2` (TRL's default mode) — masks sequences whose rollout "
                "and trainer probabilities disagree beyond the caps.",
            ),
        ),
        caveat="needs the rollout's log-probs in the snapshot (TRL keeps them when it generates with vLLM); under "
        "axrl and verl truncation caps above only and a mask needs MIN:MAX",
        settings=(
            _setting(
                "axrl",
                _run_config_correction,
                "verl's rollout correction, read under axrl too; truncate takes MAX alone, mask MIN:MAX",
            ),
            _setting("verl", _verl_correction, "truncate is verl's TIS (MAX alone), mask its IcePop (MIN:MAX)"),
            _setting(
                "trl",
                _grpo_config_correction,
                "with use_vllm and vllm_importance_sampling_correction (TRL corrects only what vLLM generated)",
            ),
            NO_MEGATRON_FLAG,
        ),
    ),
)
