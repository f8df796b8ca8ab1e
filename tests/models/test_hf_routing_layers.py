"""Routing replay across the architectures, at model level (no capture): the default sweep's configs apply to every
model the reference trainer captures (`current_routing_layers: first` resolves to each model's own first MoE
layer), the routers keep their gradient while routes are forced, and payloads indexed by absolute decoder layer
skip Qwen2-MoE's `mlp_only_layers`.
"""

from __future__ import annotations

import pytest
import torch

from axrl_spike_replay.capture.reference.model_choice import CAPTURE_MODELS
from axrl_spike_replay.capture.reference.run_config import build_run_config, parse_run_config
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigation_sets import DEFAULT_SWEEP
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, check_current_layers, parse_config
from axrl_spike_replay.models.architectures import ARCHITECTURES
from axrl_spike_replay.models.hf_policy import HFPolicy
from axrl_spike_replay.models.hf_routing import find_routers
from axrl_spike_replay.models.tiny_moe import RoutingControl, token_logprobs
from axrl_spike_replay.testing.hf_snapshot import seeded_policy


def _tokens(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(3, 1024, (batch, seq), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("model", CAPTURE_MODELS)
def test_every_default_sweep_config_applies_to_each_captured_model(model: str) -> None:
    spec = parse_run_config(build_run_config(model=model, world_size=1))
    moe_layers = spec.model.moe_layer_ids
    for config in DEFAULT_SWEEP:
        applied = apply_config(parse_config(config), spec.loss, spec.routing, moe_layers)
        check_current_layers(applied, moe_layers)  # what refused the whole sweep on deepseek_v3
    first = apply_config(parse_config({"current_routing_layers": "first"}), spec.loss, spec.routing, moe_layers)
    assert first.routing.current_routing_layers == (min(moe_layers),)
    assert first.resolved == {"current_routing_layers": [min(moe_layers)]}


def test_first_is_layer_1_of_deepseek_v3_whose_layer_0_is_dense() -> None:
    spec = parse_run_config(build_run_config(model="deepseek_v3", world_size=1))
    assert spec.model.moe_layer_ids == (1, 2)
    first = apply_config(
        parse_config({"current_routing_layers": "first"}), spec.loss, spec.routing, spec.model.moe_layer_ids
    )
    assert first.routing.current_routing_layers == (1,)
    assert first.mitigations == {"current_routing_layers": "first"}  # the config as asked; the ids in `resolved`
    absolute = apply_config(parse_config({"current_routing_layers": [0]}), spec.loss, spec.routing)
    with pytest.raises(ConfigError, match=r"\[0\] are not MoE layers \(MoE layers: \[1, 2\]\)"):
        check_current_layers(absolute, spec.model.moe_layer_ids)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_routers_get_a_gradient_through_the_forced_routes(architecture: str) -> None:
    _, model = seeded_policy(architecture)
    assert isinstance(model, HFPolicy)
    tokens = _tokens()
    with torch.no_grad():
        recorded = model(tokens).routes
    out = model(tokens, RoutingControl(routes=recorded))
    assert torch.equal(out.routes, recorded)
    # the log-probs alone, no router loss: the gate weights recomputed from the current scores carry the gradient
    token_logprobs(out.logits, tokens).sum().backward()
    routers = find_routers(model.causal_lm, architecture)
    assert sorted(routers) == list(model.moe_layer_ids)
    for layer, router in routers.items():
        grad = router.weight.grad
        assert grad is not None and bool(grad.abs().sum() > 0), f"{architecture} layer {layer}: no router gradient"


def test_qwen2_moe_payload_by_absolute_layer_skips_its_mlp_only_layers() -> None:
    _, model = seeded_policy("qwen2_moe")
    assert isinstance(model, HFPolicy)
    assert model.n_layers == 3 and model.moe_layer_ids == (0, 2)  # mlp_only_layers: [1]
    tokens = _tokens()
    with torch.no_grad():
        own = model(tokens).routes  # [B, T, 2 MoE layers, K]
        wrong = (own + 1) % model.n_experts
        per_layer = torch.empty((*own.shape[:2], model.n_layers, own.shape[3]), dtype=own.dtype)
        per_layer[:, :, 0], per_layer[:, :, 2] = wrong[:, :, 0], wrong[:, :, 1]
        per_layer[:, :, 1] = (own[:, :, 1] + 3) % model.n_experts  # valid ids in the dense layer's slot: ignored
        absolute = model(tokens, RoutingControl(routes=per_layer))
        compact = model(tokens, RoutingControl(routes=wrong))
    assert torch.equal(absolute.routes, wrong)  # layer 2 took slot 2, not the dense layer's slot 1
    assert torch.equal(absolute.logits, compact.logits)
