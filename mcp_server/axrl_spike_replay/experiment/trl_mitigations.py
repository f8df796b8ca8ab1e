"""The newer GRPO objectives as replay-only mitigations, on TRL snapshots (`loss.convention: trl`): GSPO's
sequence-level ratio, TRL's loss types (CISPO's clipped weights, SAPO's soft gate, DAPO's and Dr. GRPO's
aggregation), two-sided clipping (`delta`) and the rollout correction's modes. Each is one of TRL 1.16's own
`GRPOConfig` settings, so the replay computes exactly what TRL would have trained with (the trl convention is
checked against TRL's `_compute_loss` for every value: tests/training/test_trl_crosscheck.py). Under the axrl and
verl conventions they are refused with the reason: this tool's own loss and verl's have no such setting here.
Declared in `experiment.mitigation_table`'s one table."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation_declaration import Advice, Mitigation, ReplaySetup
from axrl_spike_replay.experiment.mitigation_values import parse_number
from axrl_spike_replay.experiment.trainer_settings import NO_MEGATRON_FLAG, none, per_value
from axrl_spike_replay.training.trl_settings import ROLLOUT_CORRECTION_MODES, TRL_IS_LEVELS, TRL_LOSS_TYPES, TrlSettings

_AXRL = "no key under convention axrl; on a TRL snapshot (loss.convention: trl) its run_config.yaml key is loss.trl.{}"


def set_trl(name: str, fields: Callable[[Any], dict[str, Any]]) -> Callable[[ReplaySetup, Any], ReplaySetup]:
    """Mitigation `name`'s value applied to the snapshot's `loss.trl` settings (`fields(value)`: the fields it
    sets); ConfigError on a snapshot of another convention."""

    def apply(setup: ReplaySetup, value: Any) -> ReplaySetup:
        loss = setup.loss
        if loss.convention != "trl":
            raise ConfigError(
                f"mitigation {name} is one of TRL's GRPO objectives: it has a meaning under loss.convention trl (a "
                f"snapshot of TRL's GRPOTrainer), not under convention {loss.convention}"
            )
        trl = dataclasses.replace(loss.trl or TrlSettings(), **fields(value))
        return dataclasses.replace(setup, loss=dataclasses.replace(loss, trl=trl))

    return apply


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
    mode, *caps = value.split(":")
    low, high = (None, float(caps[0])) if len(caps) == 1 else (float(caps[0]), float(caps[1]))
    return {
        "rollout_correction": mode,
        "rollout_correction_min": low,
        "rollout_correction_max": high,
        "rollout_correction_recorded": False,
    }


VERL_LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode={}"

TRL_OBJECTIVES: tuple[Mitigation, ...] = (
    Mitigation(
        "importance_sampling_level",
        "loss",
        "token | sequence",
        "GSPO: the importance ratio per sequence (the geometric mean of its tokens' ratios), clipped as one; TRL's "
        "GRPOConfig importance_sampling_level (TRL snapshots)",
        _choice(TRL_IS_LEVELS),
        set_trl("importance_sampling_level", lambda v: {"importance_sampling_level": v}),
        advice=(
            Advice(
                "policy_drift",
                "`importance_sampling_level: sequence` (GSPO, introduced for MoE stability) on a TRL snapshot — "
                "when token ratios are extreme but each sequence's mean ratio is near 1.",
            ),
        ),
        caveat="with loss_type dapo / bnpo / dr_grpo / cispo TRL sums the sequence's tokens, weighting long "
        "sequences more; GSPO's own setup is loss_type grpo",
        settings=(
            none("axrl", _AXRL.format("importance_sampling_level") + " (GRPOConfig importance_sampling_level)"),
            per_value("verl", {"sequence": VERL_LOSS_MODE.format("gspo")}, "verl's GSPO policy loss"),
            NO_MEGATRON_FLAG,
        ),
    ),
    Mitigation(
        "trl_loss_type",
        "loss",
        " | ".join(TRL_LOSS_TYPES),
        "TRL's loss_type: the objective and its aggregation (cispo clips the detached weights at epsilon_high, "
        "sapo gates softly, dapo / dr_grpo / bnpo / grpo / luspo normalise differently, vespo gamma-weights)",
        _choice(TRL_LOSS_TYPES),
        set_trl("trl_loss_type", lambda v: {"loss_type": v}),
        advice=(
            Advice(
                "policy_drift",
                "`trl_loss_type: cispo` on a TRL snapshot — when a few tokens' ratios dominate (CISPO bounds "
                "their weight, keeps their gradient); `sapo` for a soft gate.",
            ),
        ),
        caveat="cispo's cap is epsilon_high (clip_eps_high), which TRL's cispo setups set near 5; another "
        "aggregation changes every step's scale, not only the spike's",
        settings=(
            none("axrl", _AXRL.format("loss_type") + " (GRPOConfig loss_type)"),
            per_value(
                "verl",
                {
                    "cispo": VERL_LOSS_MODE.format("cispo"),
                    "sapo": VERL_LOSS_MODE.format("sapo"),
                    "dapo": "actor_rollout_ref.actor.loss_agg_mode=token-mean",
                    "dr_grpo": "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                },
                "verl's loss mode or aggregation of the same name, where it has one",
            ),
            NO_MEGATRON_FLAG,
        ),
    ),
    Mitigation(
        "delta",
        "loss",
        "float > 1",
        "two-sided clipping: the importance ratio capped at delta on the unclipped side too (TRL's delta)",
        _above_one,
        set_trl("delta", lambda v: {"delta": float(v)}),
        advice=(
            Advice(
                "negative_advantages",
                "`delta: 1.5` on a TRL snapshot — TRL's two-sided clip, its form of the dual clip.",
            ),
        ),
        caveat="set above 1 + epsilon_high; only ratios beyond delta change",
        settings=(
            none("axrl", _AXRL.format("delta") + " (GRPOConfig delta); this tool's form is dual_clip_c"),
            none("verl", "verl's form is the dual clip (actor_rollout_ref.actor.clip_ratio_c, mitigation dual_clip_c)"),
            NO_MEGATRON_FLAG,
        ),
    ),
    Mitigation(
        "rollout_correction",
        "loss",
        "MODE | MODE:MAX | MODE:MIN:MAX, MODE one of " + ", ".join(ROLLOUT_CORRECTION_MODES),
        "TRL's rollout correction against the generation engine: pi_old/pi_rollout per token or per sequence, "
        "truncated to [MIN, MAX] or masked outside it (MAX default 3), computed from the stored log-probs",
        parse_rollout_correction,
        set_trl("rollout_correction", rollout_correction_fields),
        advice=(
            Advice(
                "mismatch",
                "`rollout_correction: sequence_mask` on a TRL snapshot (TRL's default mode) — masks sequences "
                "whose rollout and trainer probabilities disagree beyond the cap.",
            ),
        ),
        caveat="needs the rollout's log-probs in the snapshot (TRL keeps them when it generates with vLLM)",
        settings=(
            none("axrl", _AXRL.format("rollout_correction") + " (GRPOConfig vllm_importance_sampling_mode / _clip_*)"),
            none(
                "verl",
                "verl's own rollout correction is algorithm.rollout_correction (mitigation "
                "mismatch_token_clip_max, ratio_outlier_mask)",
            ),
            NO_MEGATRON_FLAG,
        ),
    ),
)
