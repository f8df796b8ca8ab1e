"""Routing replay across the architectures, at model level (no capture): the default sweep's configs apply to every
model the reference trainer captures (`current_routing_layers: first` resolves to each model's own first MoE
layer).
"""

from __future__ import annotations

import pytest

from axrl_spike_replay.capture.model_choice import CAPTURE_MODELS
from axrl_spike_replay.capture.run_config import build_run_config, parse_run_config
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.replay.mitigation_sets import DEFAULT_SWEEP
from axrl_spike_replay.replay.mitigations import apply_config, check_current_layers, parse_config


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
