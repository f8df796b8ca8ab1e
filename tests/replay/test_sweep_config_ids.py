"""A sweep's config ids are the configs as the user typed them: each id is the `--mitigation` items that give its
config back, so a row of the results can be pasted into the next replay as it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.experiment.mitigation.mitigation_catalogue import EXAMPLES
from axrl_spike_replay.experiment.mitigation.mitigations import (
    config_id,
    config_items,
    parse_config,
    parse_mitigation_args,
)

# as a user types them, in the normal form (sorted names, values as the parser keeps them)
TYPED = [
    "advantage_clip=1",
    "drop_samples=0:3,1:5",
    "drop_ranks=1",
    "recompute=old_logprobs:rank1,routes:rank1",
    "aux_loss_coef=10.24@1",
    "advantage_outlier_mask=5,scope:group",
    "balance_negative_advantages",
    "advantage_clip=1+log_ratio_clip=5",
    "kl_clamp=1e20",
]


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - {"initial_model"}))
def test_every_mitigations_config_id_gives_its_config_back(name: str) -> None:
    """Each mitigation at its catalogue example value (a path's id is its file name: the one exception)."""
    config = parse_config({name: EXAMPLES[name]})
    assert parse_mitigation_args(config_items(config_id(config))) == config


@pytest.mark.parametrize("typed", TYPED)
def test_a_config_typed_in_normal_form_is_its_own_id(typed: str) -> None:
    assert config_id(parse_mitigation_args(config_items(typed))) == typed


def test_a_sweeps_result_rows_are_the_configs_as_typed(spike_snapshot: Path, workspace: Path, cli) -> None:
    typed = ["drop_samples=0:3,1:5", "drop_ranks=1", "advantage_clip=1+log_ratio_clip=5"]
    options = [part for t in typed for part in ("--mitigation", " ".join(config_items(t)))]
    run = cli("sweep", spike_snapshot, "--nproc", "1", "--workspace", workspace, "--json", *options)
    assert run.code == 0, run.err
    results = json.loads(run.out)["results"]
    assert [r["config_id"] for r in results] == typed
    for r in results:  # each id, pasted back, is the config that ran
        assert parse_mitigation_args(config_items(r["config_id"])) == r["mitigations"]
