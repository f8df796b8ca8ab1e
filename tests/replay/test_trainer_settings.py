"""What to change in your trainer: every mitigation's declared settings are real settings of the trainers named.

The `axrl` settings are run_config.yaml keys the trainer and the replay read, and give the same loss and routing as
the mitigation; the verl settings are keys of verl 0.9.1's own shipped config (its `_generated_ppo_*.yaml`), and
the actor's loss knobs map back through the verl hook's own reading of verl's actor config to the same loss."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from axrl_spike_replay.capture.reference.run_config import build_run_config, parse_run_config
from axrl_spike_replay.capture.verl_loss_section import section_from_actor_config
from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS, apply_config, parse_config
from axrl_spike_replay.experiment.mitigation.trainer_changes import trainer_changes
from axrl_spike_replay.experiment.mitigation.trainer_settings import TRAINERS, snapshot_trainer, trainer_of
from axrl_spike_replay.training.loss_config import LossConfig, rejection_options, rollout_is_setting
from axrl_spike_replay.training.routing_config import RoutingConfig

# One value per mitigation, as a user would write it (a new mitigation must be added here, and so checked).
SAMPLES: dict[str, Any] = {
    "mismatch_token_clip_max": 2,
    "ratio_outlier_mask": {"level": "sequence", "low": 0.25, "high": 4},
    "advantage_clip": 1,
    "log_ratio_clip": 1,
    "loss_agg_mode": "seq-mean-token-mean",
    "is_base_logprobs": "old",
    "clip_eps_low": 0.1,
    "clip_eps_high": 0.28,
    "dual_clip_c": 3,
    "kl_coef": 0.01,
    "entropy_coef": 0.001,
    "aux_loss_coef": 0.1,
    "z_loss_coef": 0.01,
    "routing_replay": "all",
    "current_routing_layers": [1],
    "balance_negative_advantages": True,
    "advantage_outlier_mask": 5,
    "drop_samples": "0:1",
    "initial_model": "/nonexistent/initial",
    "drop_ranks": "1",
    "keep_ranks": "0,2",
    "recompute": "routes:rank1,old_logprobs:rank1",
    "kl_estimator": "low_var_kl",
    "kl_clamp": 10,
    "loss_scale": "2@1",  # per rank only: a hypothesis about one rank's loss, no trainer setting
    "importance_sampling_level": "sequence",  # the newer objectives (experiment/mitigation/objective_mitigations.py)
    "trl_loss_type": "sapo",
    "sapo_temperatures": "1:2",
    "delta": 1.5,
    "rollout_correction": "sequence_mask:0.5:2",
}


def _config(name: str) -> dict[str, Any]:
    return parse_config({name: SAMPLES[name]})


def test_every_mitigation_says_what_each_trainer_sets_or_why_it_sets_nothing() -> None:
    assert set(SAMPLES) == set(MITIGATIONS)
    for name, mitigation in MITIGATIONS.items():
        declared = {s.trainer for s in mitigation.settings}
        assert mitigation.diagnostic or declared == set(TRAINERS), name
        for change in trainer_changes(_config(name)):
            assert change.setting or change.note, (name, change.trainer)  # a setting, or the reason there is none


@pytest.mark.parametrize("name", [n for n, m in MITIGATIONS.items() if any(s.trainer == "axrl" for s in m.settings)])
def test_the_run_config_setting_is_the_replayed_change(name: str) -> None:
    """`loss.KEY: VALUE` (or `routing.`) in run_config.yaml trains with exactly what the replay applied."""
    [change] = [c for c in trainer_changes(_config(name), trainers=("axrl",))]
    base = build_run_config(preset="none", steps=2)
    spec = parse_run_config(base)
    if change.setting is None:
        assert name in ("advantage_outlier_mask", "initial_model", "loss_scale") and change.note
        return
    doc = dict(base)
    for one in re.split(r", (?=(?:loss|routing)\.)", change.setting):  # one or more `section.key: value`
        key, _, text = one.partition(": ")
        section, field = key.split(".")
        doc[section] = {**doc[section], field: yaml.safe_load(text)}
    trained = parse_run_config(doc)
    replayed = apply_config(_config(name), spec.loss, spec.routing, moe_layers=(0, 1))
    assert trained.loss == replayed.loss and trained.routing == replayed.routing


def _verl_configs() -> list[dict[str, Any]]:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (scripts/setup.sh installs verl==0.9.1 --no-deps)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"
    return [yaml.safe_load((folder / f"_generated_ppo_{k}trainer.yaml").read_text()) for k in ("", "megatron_")]


def _verl_key_exists(configs: list[dict[str, Any]], key: str) -> bool:
    """A dotted key of verl's config, or a field under one of its free-form `override_*` mappings (passed on to the
    model's config: `override_config` to the HF config, `override_transformer_config` to Megatron-core's)."""
    for config in configs:
        node: Any = config
        parts = key.split(".")
        for i, part in enumerate(parts):
            if i and parts[i - 1].startswith("override_") and isinstance(node, dict):
                return True
            if not (isinstance(node, dict) and part in node):
                break
            node = node[part]
        else:
            return True
    return False


def test_the_verl_settings_are_keys_of_verl_0_9_1s_own_config() -> None:
    configs = _verl_configs()
    seen = 0
    for name in MITIGATIONS:
        for value in (
            SAMPLES[name],
            *([0] if name == "kl_coef" else []),
            *(["off"] * (name == "routing_replay")),
        ):
            for change in trainer_changes(parse_config({name: value}), trainers=("verl",)):
                for word in (change.setting or "").split():
                    key, sep, _ = word.partition("=")
                    assert sep and _verl_key_exists(configs, key), f"{name}: {key} is not in verl 0.9.1's config"
                    seen += 1
    assert seen >= 15


def test_the_trl_settings_are_fields_of_trls_grpo_config() -> None:
    """Each `name=value` of a TRL setting is a GRPOConfig field that takes the value."""
    pytest.importorskip("trl", reason="TRL is not installed (scripts/setup.sh installs the trl extra)")
    import dataclasses

    from trl.trainer.grpo_config import GRPOConfig

    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    seen = 0
    for name in MITIGATIONS:
        for change in trainer_changes(_config(name), trainers=("trl",)):
            if change.setting is None:
                continue
            values = {}
            for word in re.findall(r"(\w+)=(\{.*\}|\S+)", change.setting):
                assert word[0] in names, f"{name}: {word[0]} is not a GRPOConfig field"
                values[word[0]] = yaml.safe_load(word[1])
            GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], **values)  # TRL takes the values
            seen += 1
    assert seen >= 10


def _verl_overrides(name: str) -> dict[str, str]:
    [change] = trainer_changes(_config(name), trainers=("verl",))
    assert change.setting is not None
    return dict(word.split("=", 1) for word in change.setting.split())


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("dual_clip_c", "dual_clip_c"),
        ("clip_eps_low", "clip_eps_low"),
        ("clip_eps_high", "clip_eps_high"),
        ("loss_agg_mode", "loss_agg_mode"),
        ("entropy_coef", "entropy_coef"),
        ("kl_coef", "kl_coef"),
    ],
)
def test_the_verl_actor_settings_read_back_through_the_verl_hook_as_the_same_loss(name: str, field: str) -> None:
    """The verl hook's own reading of verl's actor config (capture/verl_loss_section.py) gives back our value."""
    prefix = "actor_rollout_ref.actor."
    actor = {k.removeprefix(prefix): yaml.safe_load(v) for k, v in _verl_overrides(name).items()}
    assert all(k.startswith(prefix) for k in _verl_overrides(name))
    section = section_from_actor_config(actor).section
    assert section[field] == pytest.approx(_config(name)[name])


def test_the_verl_rollout_correction_settings_are_the_replays_verl_mapping() -> None:
    """TIS and rejection sampling as verl's algorithm.rollout_correction would set them, read by the verl
    convention, are what the mitigations apply under it."""
    tis = _verl_overrides("mismatch_token_clip_max")
    verl_tis = LossConfig(
        convention="verl",
        rollout_is=tis["algorithm.rollout_correction.rollout_is"],
        rollout_is_threshold=float(tis["algorithm.rollout_correction.rollout_is_threshold"]),
    )
    assert rollout_is_setting(verl_tis) == rollout_is_setting(LossConfig(convention="verl", mismatch_token_clip_max=2))

    rs = _verl_overrides("ratio_outlier_mask")
    verl_rs = LossConfig(
        convention="verl",
        rollout_rs=rs["algorithm.rollout_correction.rollout_rs"],
        # read as Hydra and YAML read an override's value: `0.5_2` would be the number 0.52
        rollout_rs_threshold=yaml.safe_load(rs["algorithm.rollout_correction.rollout_rs_threshold"]),
    )
    replayed = apply_config(_config("ratio_outlier_mask"), LossConfig(convention="verl"), RoutingConfig()).loss
    assert rejection_options(verl_rs) == pytest.approx(rejection_options(replayed))


def test_the_trainer_that_wrote_a_snapshot_is_read_from_its_run_config(tmp_path: Path) -> None:
    assert trainer_of({"loss": {"convention": "verl"}}) == "verl" and trainer_of({"loss": {}}) == "axrl"
    (tmp_path / "run_config.yaml").write_text("loss: {convention: verl}\n")
    assert snapshot_trainer(tmp_path) == "verl"
    (tmp_path / "run_config.yaml").write_text("loss: [unclosed\n")
    assert snapshot_trainer(tmp_path) is None and snapshot_trainer(tmp_path / "gone") is None
