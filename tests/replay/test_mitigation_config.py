"""Mitigation configs: parsed from the CLI or a YAML set, validated with clear errors, one normal form."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import (
    MITIGATIONS,
    apply_config,
    check_distinct,
    config_id,
    load_mitigation_set,
    mitigation_args,
    parse_config,
    parse_mitigation_args,
)
from axrl_spike_replay.training.loss_config import LossConfig, RatioOutlierMask
from axrl_spike_replay.training.routing_replay import RoutingConfig

ISSUE_NAMES = {
    "mismatch_token_clip_max",
    "ratio_outlier_mask",
    "advantage_clip",
    "log_ratio_clip",
    "loss_agg_mode",
    "is_base_logprobs",
    "clip_eps_low",
    "clip_eps_high",
    "dual_clip_c",
    "kl_coef",
    "entropy_coef",
    "aux_loss_coef",
    "z_loss_coef",
    "routing_replay",
    "current_routing_layers",
    "balance_negative_advantages",
    "advantage_outlier_mask",
    "drop_samples",
    "initial_model",
    "drop_ranks",
    "keep_ranks",
    "recompute",
    "kl_estimator",
    "kl_clamp",
    "loss_scale",
    "importance_sampling_level",  # the newer objectives (experiment/mitigation/objective_mitigations.py)
    "trl_loss_type",
    "sapo_temperatures",
    "delta",
    "rollout_correction",
}


def test_the_registry_names_every_mitigation_with_its_values_and_doc() -> None:
    assert set(MITIGATIONS) == ISSUE_NAMES
    for m in MITIGATIONS.values():
        assert m.values and m.doc and m.target in ("loss", "routing", "weights", "signals")


def test_cli_items_and_yaml_spellings_normalise_to_one_config(tmp_path: Path) -> None:
    cli = parse_mitigation_args(
        ["advantage_clip=2", "current_routing_layers=1,0", "ratio_outlier_mask=sequence", "balance_negative_advantages"]
    )
    file = tmp_path / "set.yaml"
    file.write_text(
        "- {balance_negative_advantages: true, advantage_clip: 2.0, current_routing_layers: [0, 1],\n"
        "   ratio_outlier_mask: {level: sequence}}\n"
        "- {mismatch_token_clip_max: 2}\n",
        encoding="utf-8",
    )
    from_yaml = load_mitigation_set(file)
    assert cli == from_yaml[0]
    assert list(cli) == sorted(cli)
    assert cli["advantage_clip"] == 2.0 and isinstance(cli["advantage_clip"], float)
    assert cli["current_routing_layers"] == [0, 1]
    assert cli["ratio_outlier_mask"] == {"base": "rollout", "high": 2.0, "level": "sequence", "low": 0.5}
    assert parse_mitigation_args(mitigation_args(cli)) == cli  # round trip through command lines
    assert config_id(from_yaml[1]) == "mismatch_token_clip_max=2"
    assert config_id({}) == "baseline"


def test_ratio_mask_accepts_key_value_pairs_and_flow_mappings() -> None:
    a = parse_mitigation_args(["ratio_outlier_mask=level:sequence,high:1.5,base:old"])
    b = parse_mitigation_args(["ratio_outlier_mask={level: sequence, high: 1.5, base: old}"])
    assert a == b
    assert config_id(a) == "ratio_outlier_mask=base:old,high:1.5,level:sequence"


def test_unknown_name_lists_every_valid_mitigation() -> None:
    with pytest.raises(ConfigError) as err:
        parse_mitigation_args(["advantage_clamp=1"])
    message = str(err.value)
    assert "unknown mitigation 'advantage_clamp'" in message
    for name in ISSUE_NAMES:
        assert name in message


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("advantage_clip=-1", "must be > 0"),
        ("advantage_clip=abc", "expected a number"),
        ("advantage_clip", "needs a value"),
        ("loss_agg_mode=mean", "token-mean, seq-mean-token-mean"),
        ("routing_replay=sometimes", "off, all, loss_tokens"),
        ("dual_clip_c=1", "must be > 1"),
        ("current_routing_layers=a", "not a layer id"),
        ("ratio_outlier_mask=level:row", "token, sequence"),
        ("ratio_outlier_mask=low:3,high:2", "low < high"),
        ("ratio_outlier_mask=width:2", "unknown keys ['width']"),
        ("balance_negative_advantages=maybe", "expected true or false"),
        ("kl_coef=inf", "finite"),
    ],
)
def test_bad_values_say_what_is_accepted(item: str, words: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        parse_mitigation_args([item])
    assert words in str(err.value)


def test_a_name_given_twice_and_duplicate_configs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="given twice"):
        parse_mitigation_args(["kl_coef=1", "kl_coef=2"])
    with pytest.raises(ConfigError, match="configs 1 and 2 are the same"):
        check_distinct([parse_config({"kl_coef": 1}), parse_config({"kl_coef": "1.0"})])
    with pytest.raises(ConfigError, match="that is the baseline"):
        check_distinct([{}])
    bad = tmp_path / "bad.yaml"
    bad.write_text("advantage_clip: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="expected a non-empty list"):
        load_mitigation_set(bad)
    bad.write_text("- {advantage_clip: 1}\n- {nope: 2}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="unknown mitigation 'nope'"):
        load_mitigation_set(bad)


def test_configs_map_onto_loss_routing_and_weights(tmp_path: Path) -> None:
    saved_loss, saved_routing = LossConfig(kl_coef=0.01), RoutingConfig(replay="all")
    applied = apply_config(
        parse_config(
            {
                "ratio_outlier_mask": True,
                "kl_coef": 0,
                "routing_replay": "loss_tokens",
                "current_routing_layers": [1],
                "initial_model": str(tmp_path / "init"),
            }
        ),
        saved_loss,
        saved_routing,
    )
    assert applied.loss.kl_coef == 0 and applied.loss.ratio_outlier_mask == RatioOutlierMask()
    assert applied.routing == RoutingConfig(replay="loss_tokens", current_routing_layers=(1,))
    assert applied.weights == str(tmp_path / "init")
    baseline = apply_config({}, saved_loss, saved_routing)
    assert baseline.loss == saved_loss and baseline.routing == saved_routing and baseline.weights is None
    loss_only = apply_config(parse_config({"advantage_clip": 1}), saved_loss, saved_routing)
    assert loss_only.forward_key == baseline.forward_key  # shares the baseline's forward in a sweep
    assert applied.forward_key != baseline.forward_key
