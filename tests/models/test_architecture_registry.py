"""Every declared architecture is whole: one entry in models.architectures is all the engine, the reference trainer
and the tests need. Walked against transformers' own build of each tiny model: its config passes the size bounds,
its routing hook finds a router in every MoE layer, its weight rule gives back the router's own gate weights bit for
bit from the router's own choice, and every name the other modules list comes from the registry."""

from __future__ import annotations

import pytest
import torch

from axrl_spike_replay.capture.reference.model_choice import CAPTURE_MODELS, HF_CAPTURE_MODELS, hf_model_section
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.architectures import ARCHITECTURES, TINY_BASE, Architecture, architecture
from axrl_spike_replay.models.hf_config import SIZE_LIMITS, HFModelConfig, instantiate
from axrl_spike_replay.models.hf_routing import find_routers
from axrl_spike_replay.testing.hf_snapshot import tiny_config


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_declared_architecture_builds_routes_and_weighs_as_transformers_does(name: str) -> None:
    spec = architecture(name)
    assert spec.name == name
    config = spec.tiny_config()
    assert config["model_type"] == name and set(TINY_BASE) <= set(config)
    for key, limit in spec.size_limits.items():
        assert SIZE_LIMITS[key] == limit  # its own sizing keys are bounded before anything is built
    experts = [key for key in spec.size_limits if isinstance(config.get(key), int) and config[key] == 8]
    assert experts, f"{name}: its experts-count key is not among its size keys"

    model_config = HFModelConfig(architecture=name, config=config)  # sizes checked, meta build, routers found
    torch.manual_seed(0)
    model = instantiate(model_config, "cpu")
    routers = find_routers(model, name)
    assert routers and tuple(sorted(routers)) == model_config.moe_layer_ids
    assert model_config.top_k == config["num_experts_per_tok"]

    hidden = torch.randn(16, config["hidden_size"], generator=torch.Generator().manual_seed(1))
    for layer, router in routers.items():
        with torch.no_grad():
            router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(layer))
            logits, weights, chosen = router(hidden)
            assert torch.equal(spec.weight_rule(router, logits, chosen), weights), f"{name} layer {layer}"


def test_every_list_of_architectures_is_the_registry() -> None:
    assert tuple(HF_CAPTURE_MODELS) == tuple(ARCHITECTURES) and CAPTURE_MODELS[1:] == tuple(ARCHITECTURES)
    for name, spec in ARCHITECTURES.items():
        section = hf_model_section(name)
        assert section["config"] == spec.tiny_config() and section["architecture"] == name
        assert tiny_config(name) == {k: v for k, v in spec.tiny_config().items() if k != "model_type"}


def test_an_undeclared_architecture_is_refused_by_name_with_the_declared_ones() -> None:
    with pytest.raises(ConfigError, match="architecture 'llama' is not declared") as info:
        architecture("llama")
    assert all(name in str(info.value) for name in ARCHITECTURES)
    with pytest.raises(ConfigError, match=r"built: qwen3_moe, qwen2_moe"):
        HFModelConfig(architecture="llama", config={"model_type": "llama"})


def test_a_spec_is_one_value_the_tiny_config_a_fresh_copy() -> None:
    spec = ARCHITECTURES["qwen2_moe"]
    assert isinstance(spec, Architecture)
    first = spec.tiny_config()
    first["mlp_only_layers"].append(0)
    assert spec.tiny_config()["mlp_only_layers"] == [1]
