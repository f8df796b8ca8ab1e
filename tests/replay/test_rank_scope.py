"""A loss setting scoped to saved ranks (`NAME=VALUE@RANKS`, experiment.mitigation.rank_scope): its spellings
normalise to one config, it applies to the named ranks' loss only, it is a hypothesis (judged against the recording,
never called a mitigation), and bad input is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import (
    MITIGATIONS,
    apply_config,
    config_id,
    mitigation_args,
    normal_form,
    parse_config,
    parse_mitigation_args,
)
from axrl_spike_replay.experiment.mitigation.rank_scope import REQUIRED, is_hypothesis
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.remote.command.command_overrides import check_concrete
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.sweep import run_sweep
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.vocabulary import Verb

# every loss setting the issue names, and a plain scale of one rank's loss
SCOPED = (
    "aux_loss_coef",
    "z_loss_coef",
    "kl_coef",
    "entropy_coef",
    "clip_eps_low",
    "clip_eps_high",
    "loss_agg_mode",
    "is_base_logprobs",
    "loss_scale",
)


def test_every_loss_setting_declares_its_rank_scope_and_nothing_else_does() -> None:
    for name in SCOPED:
        assert MITIGATIONS[name].per_rank, name
    assert MITIGATIONS["loss_scale"].per_rank == REQUIRED
    for name, m in MITIGATIONS.items():
        if m.per_rank:
            assert m.target == "loss", name
    for name in ("drop_ranks", "keep_ranks", "drop_samples", "routing_replay", "recompute", "initial_model"):
        assert not MITIGATIONS[name].per_rank, name


def test_the_spellings_of_a_scoped_setting_normalise_to_one_config() -> None:
    cli = parse_mitigation_args(["aux_loss_coef=10.24@1", "loss_agg_mode=seq-mean-token-mean@2,0"])
    yaml = parse_config(
        {
            "loss_agg_mode": {"value": "seq-mean-token-mean", "ranks": [0, 2]},
            "aux_loss_coef": {"ranks": "1", "value": "10.240"},
        }
    )
    assert (
        cli
        == yaml
        == {
            "aux_loss_coef": {"ranks": [1], "value": 10.24},
            "loss_agg_mode": {"ranks": [0, 2], "value": "seq-mean-token-mean"},
        }
    )
    assert normal_form({"aux_loss_coef": "10.24@1", "loss_agg_mode": "seq-mean-token-mean@0,2"}) == cli
    assert mitigation_args(cli) == ["aux_loss_coef=10.24@1", "loss_agg_mode=seq-mean-token-mean@0,2"]
    assert parse_mitigation_args(mitigation_args(cli)) == cli
    assert config_id(cli) == "aux_loss_coef=10.24@1+loss_agg_mode=seq-mean-token-mean@0,2"
    assert is_hypothesis(cli) and not is_hypothesis({"aux_loss_coef": 10.24}) and not is_hypothesis({})


def test_a_scoped_setting_changes_the_named_ranks_loss_only() -> None:
    config = parse_mitigation_args(["aux_loss_coef=10.24@1", "loss_scale=2@0,1"])
    applied = apply_config(config, LossConfig(aux_loss_coef=0.01, kl_coef=0.1), RoutingConfig())
    assert applied.loss == LossConfig(aux_loss_coef=0.01, kl_coef=0.1)  # every other rank: the run's loss
    assert applied.loss_of(1) == LossConfig(aux_loss_coef=10.24, kl_coef=0.1, loss_scale=2.0)
    assert applied.loss_of(0) == LossConfig(aux_loss_coef=0.01, kl_coef=0.1, loss_scale=2.0)
    assert applied.loss_of(2) == applied.loss
    assert applied.is_hypothesis and applied.label == "the hypothesis aux_loss_coef=10.24@1 loss_scale=2@0,1"


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["loss_scale=2"], "only has a meaning on some ranks"),
        (["aux_loss_coef=1@x"], "is not a rank id"),
        (["aux_loss_coef=1@"], "name at least one rank"),
        (["aux_loss_coef=-1@1"], "must be >= 0"),
        (["loss_agg_mode=mean@1"], "must be one of"),
        (["drop_ranks=1@0"], "cannot be scoped to ranks"),
        (["aux_loss_coef=10.24@1", "kl_coef=0.1"], "cannot be combined with kl_coef"),
    ],
)
def test_bad_scoped_input_is_refused_by_name(items: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_mitigation_args(items)


def test_the_command_backend_refuses_a_scoped_setting_by_name() -> None:
    """A trainer's own overrides set its loss for every rank: a hypothesis replays in the torch engine only."""
    with pytest.raises(ConfigError, match=r"aux_loss_coef scoped to ranks.*torch engine only"):
        check_concrete([{}, parse_mitigation_args(["aux_loss_coef=1@1"])])


def test_a_scope_naming_a_rank_the_snapshot_lacks_is_refused(spike_snapshot: Path) -> None:
    with pytest.raises(ConfigError, match="names rank 2, not in the snapshot"):
        run_replay(replay_request(What(spike_snapshot, mitigations={"kl_coef": "0.5@2"}), how=How(nproc=1)))


@pytest.mark.slow
def test_a_hypothesis_is_judged_against_the_recording_and_on_every_rank_equals_the_mitigation(
    spike_snapshot: Path,
) -> None:
    """`kl_coef=0.5@0,1` names every rank: its gradient is the unscoped `kl_coef=0.5`'s, to the bit, but it is judged
    as a baseline is (against the recording), the mitigation against the baseline; `@1` alone moves rank 1's loss
    and leaves rank 0's as recorded."""
    sweep = run_sweep(
        replay_request(
            What(
                spike_snapshot,
                verb=Verb.SWEEP,
                configs=tuple([{"kl_coef": "0.5@0,1"}, {"kl_coef": 0.5}, {"kl_coef": "0.5@1"}]),
            ),
            how=How(nproc=1),
        )
    )
    everywhere, mitigation, one = sweep.results
    assert everywhere.grad_norm == mitigation.grad_norm
    assert everywhere.mitigations == {} and everywhere.hypothesis == {"kl_coef": {"ranks": [0, 1], "value": 0.5}}
    assert everywhere.verdict == "not_reproduced" and everywhere.baseline_grad_norm is None
    assert everywhere.finding == "not reproduced under `kl_coef=0.5@0,1`"
    assert everywhere.footprint is None and everywhere.clean_gradient is None  # a mitigation's figures, not its
    assert mitigation.finding is None and mitigation.mitigations == {"kl_coef": 0.5}
    losses = {row["rank"]: row for row in one.verdict_basis.rank_losses}
    # rank 0 computes the recorded loss as the baseline does, to the bit (the golden capture was recorded on another
    # machine, whose arithmetic may sit a float32 ulp or so off this one's: this run's baseline is the exact witness)
    base = {m["rank"]: m["loss"] for m in sweep.baseline.rank_metrics}
    assert losses[0]["matches"] is True and losses[0]["replayed_loss"] == base[0]
    assert losses[0]["abs_diff"] == abs(losses[0]["recorded_loss"] - base[0])
    assert losses[1]["matches"] is False
    assert next(m["loss"] for m in one.rank_metrics if m["rank"] == 0) == base[0]
