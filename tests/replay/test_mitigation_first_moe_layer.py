"""`current_routing_layers: first`: one normal form and one stable key for every spelling, never equal to an id
list; resolved only against a model's MoE layers; refused where no model is built (the command backend); and the
method files written with absolute ids (the shipped `current-routing-first-moe-layer`) still list and still match
their own keys, so duplicate checks against them work."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigation_sets import SEED_WORKFLOW_METHODS
from axrl_spike_replay.experiment.mitigation.mitigations import (
    apply_config,
    config_id,
    mitigation_args,
    parse_config,
    parse_mitigation_args,
)
from axrl_spike_replay.remote.command.command_overrides import check_concrete
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.workspace.method_files.methods import list_methods
from axrl_spike_replay.workspace.method_files.sweep_writeup import method_name
from axrl_spike_replay.workspace.task_record.changes import config_key, describe_change, normalise_config

# Pinned: records and method files hash their configs with these; a change would orphan them.
FIRST_KEY = "90baa3c8e99140de2945a196ad231e5e4db07d0b82c97e22a90164f23fbdb3a5"
LAYER_0_KEY = "ce039fcb37066451297d69521e6eb2b8cc2ebb8a5e64e40304761f338d2d779c"  # the shipped method's key


@pytest.mark.parametrize("spelling", ["first", " FIRST ", "[first]", ["first"], ("first",)])
def test_every_spelling_of_first_has_one_normal_form_and_key(spelling: object) -> None:
    parsed = parse_config({"current_routing_layers": spelling})
    assert parsed == {"current_routing_layers": "first"}
    assert normalise_config({"current_routing_layers": spelling}) == parsed
    assert config_key(parsed) == FIRST_KEY
    assert config_id(parsed) == "current_routing_layers=first"
    assert describe_change(parsed) == "current_routing_layers=first"
    assert parse_mitigation_args(mitigation_args(parsed)) == parsed  # the command line written into a run


def test_first_and_absolute_ids_stay_different_configs() -> None:
    assert config_key({"current_routing_layers": [0]}) == LAYER_0_KEY
    assert config_key({"current_routing_layers": "0"}) == LAYER_0_KEY
    assert FIRST_KEY != LAYER_0_KEY  # `first` is layer 1 on deepseek_v3: never the same change as [0]


@pytest.mark.parametrize("value", ["first,1", ["first", 2], "second"])
def test_first_stands_alone(value: object) -> None:
    with pytest.raises(ConfigError, match="current_routing_layers"):
        parse_config({"current_routing_layers": value})


def test_first_resolves_against_the_models_moe_layers_only() -> None:
    config = parse_config({"current_routing_layers": "first", "advantage_clip": 1})
    applied = apply_config(config, LossConfig(), RoutingConfig(replay="all"), (2, 1, 3))
    assert applied.routing.current_routing_layers == (1,)
    assert applied.resolved == {"current_routing_layers": [1]}
    assert applied.config_id == "advantage_clip=1+current_routing_layers=first"
    ids = apply_config(parse_config({"current_routing_layers": "2,1"}), LossConfig(), RoutingConfig(), (1, 2))
    assert ids.routing.current_routing_layers == (1, 2) and ids.resolved == {}  # ids are used as given
    with pytest.raises(ConfigError, match="first MoE layer"):
        apply_config(config, LossConfig(), RoutingConfig(replay="all"))


def test_the_command_backend_refuses_first_and_takes_ids() -> None:
    check_concrete([{}, {"current_routing_layers": [1]}])
    with pytest.raises(ConfigError, match="name the layer ids") as caught:
        check_concrete([{"advantage_clip": 1.0}, parse_config({"current_routing_layers": "first"})])
    assert caught.value.parameter == "mitigations"


def test_the_seed_workflow_names_its_first_layer_config() -> None:
    config = parse_config(SEED_WORKFLOW_METHODS["current-routing-first-moe-layer"])
    assert config == {"current_routing_layers": "first"}
    assert method_name(config_id(config)) == "current-routing-first-moe-layer"


def test_shipped_method_files_list_and_match_their_own_keys(tmp_path: Path) -> None:
    shipped = [m for m in list_methods(tmp_path) if m.source == "shipped"]
    assert "current-routing-first-moe-layer" in {m.slug for m in shipped}
    for method in shipped:
        fields = method.front_matter
        if fields.get("patch_sha256"):
            continue
        parse_config(fields["mitigations"])  # what it records is still a valid config
        assert config_key(fields["mitigations"]) == fields["config_key"], method.slug
