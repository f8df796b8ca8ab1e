"""One normal form for a mitigation config: what `parse_config` returns is what the task record, the method
files and the config hash store, however the value was spelled."""

from __future__ import annotations

import pytest

from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.workspace.task_record.changes import config_key, describe_change, normalise_config


@pytest.mark.parametrize("spelling", [2, 2.0, "2", "2.0", " 2 "])
def test_every_spelling_of_a_number_parses_to_what_the_record_stores(spelling: object) -> None:
    parsed = parse_config({"mismatch_token_clip_max": spelling})
    assert parsed == {"mismatch_token_clip_max": 2.0} and type(parsed["mismatch_token_clip_max"]) is float
    assert normalise_config(parsed) == parsed
    assert config_key(parsed) == config_key({"mismatch_token_clip_max": 2})  # as method files written before
    assert describe_change(parsed) == "mismatch_token_clip_max=2"


def test_a_parsed_config_is_already_in_normal_form() -> None:
    parsed = parse_config({"ratio_outlier_mask": "sequence", "current_routing_layers": "1,0", "dual_clip_c": 3.0})
    assert normalise_config(parsed) == parsed
    assert list(parsed) == sorted(parsed)


def test_the_replay_still_runs_with_float_knobs() -> None:
    applied = apply_config(
        parse_config({"advantage_clip": "1", "ratio_outlier_mask": True}), LossConfig(), RoutingConfig()
    )
    assert type(applied.loss.advantage_clip) is float and applied.loss.advantage_clip == 1.0
    mask = applied.loss.ratio_outlier_mask
    assert mask is not None and type(mask.high) is float and mask.high == 2.0
