"""A snapshot the verl hook writes names its model: the actor's HF config, compute dtype, kernels and routing
mode go into run_config.yaml, and the replay's own parser reads that `model:` section back.

The actor is a real transformers MoE model (tiny qwen3_moe); the hook runs its guard over a few steps until a
spike trips it, exactly as the patched FSDP engine calls it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from axrl_spike_replay.integrations import VERL_PATCH
from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.policy import build_policy, parse_model_config
from axrl_spike_replay.testing.hf_snapshot import tiny_config
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

VERL_HOOK_FILE = VERL_PATCH.with_name("verl.py")  # the hook shipped in the package, loaded by path as a copy


def _load_hook():
    spec = importlib.util.spec_from_file_location("axrl_verl_hook_rc", VERL_HOOK_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _actor() -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING["qwen3_moe"](**tiny_config("qwen3_moe"))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def test_a_hook_written_run_config_names_a_model_the_replay_can_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AXRL_SPIKE_DIR", str(tmp_path / "spikes"))
    monkeypatch.setenv("AXRL_SPIKE_WARMUP", "3")
    monkeypatch.setenv("AXRL_SPIKE_WINDOW", "5")
    monkeypatch.setenv("AXRL_JOB_NAME", "verl-qwen3")
    hook = _load_hook()
    actor = _actor()
    batch = {
        "input_ids": torch.randint(3, 1024, (2, 12)),
        "response_mask": torch.ones(2, 4),
        "old_log_probs": torch.zeros(2, 4),
        "advantages": torch.ones(2, 4),
        "temperature": 0.7,
    }
    engine = SimpleNamespace(
        module=actor,
        optimizer=torch.optim.SGD(actor.parameters(), lr=0.0),
        engine_config=SimpleNamespace(router_replay=SimpleNamespace(mode="R3")),
        _autocast_dtype=torch.bfloat16,
        _axrl_spike_batch=batch,
    )
    steps = [hook.guard_step(engine, torch.tensor(norm)) for norm in (1.0, 1.1, 0.9, 1.0, 50.0)]
    assert steps[:4] == [True] * 4 and steps[4] is False  # the spike is skipped

    (written,) = (tmp_path / "spikes").rglob("run_config.yaml")
    doc = read_untrusted_yaml(written)
    spec = parse_model_config(doc["model"])
    assert isinstance(spec, HFModelConfig)
    assert spec.architecture == "qwen3_moe" and spec.dtype == "bfloat16" and spec.temperature == pytest.approx(0.7)
    assert spec.attn_implementation == "eager" and spec.experts_implementation == actor.config._experts_implementation
    assert spec.moe_layer_ids == (0, 1) and spec.top_k == 2
    rebuilt = build_policy(spec)  # the replay's policy has the actor's parameters, name for name, shape for shape
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in actor.state_dict().items()}
    assert RoutingConfig.from_dict(doc["routing"]).replay == "all"
    assert doc["loss"]["convention"] == "verl"


def test_a_flash_attention_actor_is_recorded_as_it_ran_and_refused_with_the_reason() -> None:
    from axrl_spike_replay.errors import ConfigError
    from axrl_spike_replay.models.attention_kernels import check_attention_runs

    hook = _load_hook()
    actor = _actor()
    actor.config._attn_implementation = "flash_attention_2"  # what verl loads actors with on GPUs
    section = hook.model_section(actor, torch.bfloat16)
    assert section["attn_implementation"] == "flash_attention_2"
    spec = parse_model_config(section)  # read as it ran: `plan` counts it anywhere
    with pytest.raises(ConfigError, match=r"flash_attention_2 cannot run here.*nearest kernel that runs here is sdpa"):
        check_attention_runs(spec.attn_implementation, spec.dtype, "cpu")  # what a replay here checks first


def ppo_loss(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> Any:
    """Named as verl's `verl.workers.utils.losses.ppo_loss`: the hook reads the actor config bound to it."""
    raise AssertionError("the hook reads the loss function's settings, it never calls it")


def distillation_ppo_loss(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> Any:
    raise AssertionError("never called")


def actor_config(**overrides: Any) -> dict[str, Any]:
    """verl's ActorConfig fields the loss reads, with verl 0.9.1's defaults (verl/trainer/config/actor/actor.yaml)."""
    return {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "loss_scale_factor": None,
        "entropy_coeff": 0,
        "use_kl_loss": False,
        "kl_loss_coef": 0.001,
        "kl_loss_type": "low_var_kl",
        "policy_loss": {"loss_mode": "vanilla"},
        **overrides,
    }


def test_verl_s_actor_settings_map_onto_the_loss_section_the_replay_parses() -> None:
    from functools import partial

    from axrl_spike_replay.capture.verl_loss_section import loss_section
    from axrl_spike_replay.training.loss_config import LossConfig

    doc = loss_section(partial(ppo_loss, config=actor_config()))  # verl's defaults
    cfg = LossConfig.from_dict(doc)
    assert (cfg.convention, cfg.normalization, cfg.dual_clip_c, cfg.kl_coef) == ("verl", "global", 3.0, 0.0)
    doc = loss_section(
        partial(
            ppo_loss,
            config=actor_config(
                clip_ratio=0.3,
                clip_ratio_low=None,
                clip_ratio_high=0.4,
                loss_agg_mode="seq-mean-token-sum-norm",
                loss_scale_factor=2048,
                use_kl_loss=True,
                kl_loss_type="kl+",
            ),
        )
    )
    cfg = LossConfig.from_dict(doc)
    assert (cfg.clip_eps_low, cfg.clip_eps_high) == (0.3, 0.4)  # an unset side falls back to clip_ratio, as in verl
    assert (cfg.loss_agg_mode, cfg.loss_scale_factor) == ("seq-mean-token-sum-norm", 2048.0)
    assert (cfg.kl_coef, cfg.kl_estimator) == (0.001, "k1+")  # verl's "kl" is k1


@pytest.mark.parametrize("mode", ["gspo", "cispo", "sapo"])
def test_verl_s_gspo_cispo_and_sapo_losses_are_recorded_as_the_policy_objective(mode: str) -> None:
    """verl's other registered policy losses the convention computes (checked against verl's own in
    tests/training/test_verl_objectives.py): recorded, with SAPO's temperatures, and without the dual clip they do
    not read."""
    from functools import partial

    from axrl_spike_replay.capture.verl_loss_section import loss_section
    from axrl_spike_replay.training.loss_config import LossConfig

    config = actor_config(policy_loss={"loss_mode": mode}, tau_pos=0.5, tau_neg=2.0)
    doc = loss_section(partial(ppo_loss, config=config))
    assert "unreproduced" not in doc
    cfg = LossConfig.from_dict(doc)
    assert (cfg.policy_loss_mode, cfg.dual_clip_c) == (mode, None)
    taus = (0.5, 2.0) if mode == "sapo" else (1.0, 1.05)
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg) == taus


@pytest.mark.parametrize(
    ("function", "overrides", "named"),
    [
        (ppo_loss, {"policy_loss": {"loss_mode": "geo_mean"}}, "loss_mode=geo_mean"),
        (ppo_loss, {"policy_loss": {"loss_mode": "bypass_mode"}}, "bypass mode"),
        (ppo_loss, {"entropy_coeff": -0.01}, "entropy_coef must be a finite number >= 0"),
        (ppo_loss, {"use_kl_loss": True, "kl_loss_type": "full"}, "kl_loss_type=full"),
        (ppo_loss, {"clip_ratio_c": None}, "the actor config could not be read"),  # recorded, never raised in training
        (distillation_ppo_loss, {}, "loss function distillation_ppo_loss"),
    ],
)
def test_settings_the_convention_cannot_hold_are_recorded_and_refused(
    function: Any, overrides: dict[str, Any], named: str
) -> None:
    from functools import partial

    from axrl_spike_replay.capture.verl_loss_section import loss_section
    from axrl_spike_replay.errors import ConfigError
    from axrl_spike_replay.training.loss_config import LossConfig

    doc = loss_section(partial(function, config=actor_config(**overrides)))
    assert any(named in item for item in doc["unreproduced"]), doc["unreproduced"]
    with pytest.raises(ConfigError, match="does not reproduce"):
        LossConfig.from_dict(doc)


def test_the_hook_warns_at_the_first_step_when_a_snapshot_could_not_be_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from functools import partial

    monkeypatch.setenv("AXRL_SPIKE_DIR", str(tmp_path / "spikes"))
    hook = _load_hook()
    actor = _actor()
    engine = SimpleNamespace(
        module=actor,
        optimizer=torch.optim.SGD(actor.parameters(), lr=0.0),
        _axrl_spike_loss_fn=partial(ppo_loss, config=actor_config(policy_loss={"loss_mode": "clip_cov"})),
    )
    with caplog.at_level("WARNING", logger="axrl_spike_replay.verl_hook"):
        assert hook.guard_step(engine, torch.tensor(1.0)) and hook.guard_step(engine, torch.tensor(1.0))
    warned = [r.getMessage() for r in caplog.records if r.name == "axrl_spike_replay.verl_hook"]
    warned = [m for m in warned if "loss setting" in m]  # (it also says once that no global step is on the batch)
    assert len(warned) == 1 and "loss_mode=clip_cov" in warned[0]


@pytest.mark.parametrize(
    ("engine_config", "expected"),
    [
        (  # verl's FSDP engine with no mixed_precision: its own defaults, bf16 parameters and fp32 reduction
            SimpleNamespace(strategy="fsdp2", mixed_precision=None),
            {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None},
        ),
        (
            SimpleNamespace(strategy="fsdp", mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"}),
            {"param_dtype": "float32", "reduce_dtype": "float32", "output_dtype": None},
        ),
        (SimpleNamespace(strategy="megatron", mixed_precision=None), None),  # not an FSDP engine: nothing recorded
    ],
)
def test_the_hook_records_the_fsdp_engines_mixed_precision(engine_config: Any, expected: Any) -> None:
    hook = _load_hook()
    engine = SimpleNamespace(module=_actor(), engine_config=engine_config, _autocast_dtype=torch.bfloat16)
    doc = hook.run_config(2, engine)
    assert doc.get("precision") == expected
