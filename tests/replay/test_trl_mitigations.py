"""The newer GRPO objectives as mitigations on a TRL snapshot: each replays exactly the loss TRL's own GRPOConfig
setting would have trained with (the section `capture.trl_loss_section` writes for a real GRPOConfig with that
setting, whose loss tests/training/test_trl_crosscheck.py checks against TRL's `_compute_loss`). Their meaning
under the axrl and verl conventions is tests/replay/test_objective_mitigations.py's."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl", reason="TRL is not installed (scripts/setup.sh installs the trl extra)")

from axrl_spike_replay.capture.trl_loss_section import trl_loss_config, trl_loss_section
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig

# mitigation value -> the GRPOConfig settings TRL trains the same loss with
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "gspo": ({"importance_sampling_level": "sequence"}, {"importance_sampling_level": "sequence"}),
    "cispo": ({"trl_loss_type": "cispo"}, {"loss_type": "cispo"}),
    "sapo": ({"trl_loss_type": "sapo"}, {"loss_type": "sapo"}),
    "dr_grpo": ({"trl_loss_type": "dr_grpo"}, {"loss_type": "dr_grpo"}),
    "delta": ({"delta": 1.5}, {"delta": 1.5}),
    "sapo temperatures": (
        {"trl_loss_type": "sapo", "sapo_temperatures": "0.5:2"},
        {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
    ),
    "token_mask": (
        {"rollout_correction": "token_mask:0.5:2"},
        {
            "vllm_importance_sampling_mode": "token_mask",
            "vllm_importance_sampling_clip_min": 0.5,
            "vllm_importance_sampling_clip_max": 2.0,
        },
    ),
    "sequence_truncate": (
        {"rollout_correction": "sequence_truncate"},
        {"vllm_importance_sampling_mode": "sequence_truncate"},
    ),
}


def _loss(use_vllm: bool = False, **settings: Any) -> LossConfig:
    from trl import GRPOConfig, __version__

    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], **{"loss_type": "dapo", **settings})
    section = trl_loss_section(
        args, gradient_accumulation_steps=1, num_processes=1, aux_loss_coef=0.0, version=__version__, use_vllm=use_vllm
    )
    return trl_loss_config(section)


@pytest.mark.parametrize("name", list(CASES))
def test_each_objective_replays_the_loss_its_grpo_config_setting_trains_with(name: str) -> None:
    mitigation, grpo_config = CASES[name]
    applied = apply_config(parse_config(mitigation), _loss(), RoutingConfig())
    expected = _loss(use_vllm="rollout_correction" in mitigation, **grpo_config)
    assert applied.loss.trl is not None and expected.trl is not None
    got = applied.loss.trl.to_dict()
    want = expected.trl.to_dict()
    if "rollout_correction" in mitigation:  # a mitigation's ratio is computed, the trainer's own is recorded
        assert got.pop("rollout_correction_recorded") is False and want.pop("rollout_correction_recorded") is True
    assert got == want
    assert applied.loss.to_dict() | {"trl": None} == expected.to_dict() | {"trl": None}


def test_a_bad_rollout_correction_is_named() -> None:
    for bad in ("token", "token_mask:x", "token_mask:2:1", "token_mask:1:2:3"):
        with pytest.raises(ConfigError, match="mitigation rollout_correction"):
            parse_config({"rollout_correction": bad})


def test_the_command_lines_spellings_parse_as_the_yaml_ones() -> None:
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args

    cli = ["delta=1.5", "importance_sampling_level=sequence", "trl_loss_type=cispo", "rollout_correction=token_mask:2"]
    assert parse_mitigation_args(cli) == parse_config(
        {
            "delta": 1.5,
            "importance_sampling_level": "sequence",
            "trl_loss_type": "cispo",
            "rollout_correction": "token_mask:2",
        }
    )
