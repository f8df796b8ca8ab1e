"""On a TRL snapshot a diagnosis suggests TRL's own objectives: the dual clip as TRL's `delta`, the ratio mask as
its rollout correction; nothing TRL's loss would refuse. Every suggestion runs on the snapshot's config (it applies
without error); other conventions' suggestions are untouched. (GSPO and CISPO join a mismatch cause's truncated IS
only where the stored log-probs point to them: test_objective_suggestions.py.)
"""

from __future__ import annotations

from axrl_spike_replay.diagnosis.rules.causes import Experiment
from axrl_spike_replay.diagnosis.suggestions.convention_experiments import in_convention
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_mitigation_args
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig

SUGGESTED = [
    Experiment("mismatch_token_clip_max=2", "truncated IS"),
    Experiment("ratio_outlier_mask=token", "mask"),
    Experiment("dual_clip_c=3", "dual clip"),
    Experiment("kl_estimator=k2", "estimator"),
    Experiment("kl_clamp=10", "clamp"),
    Experiment("kl_coef=0", "no KL"),
    Experiment("advantage_clip=1", "clip"),
]


def test_on_a_trl_snapshot_the_suggestions_are_trls_own_and_every_one_runs() -> None:
    loss, routing = LossConfig.from_dict({"convention": "trl", "kl_coef": 0.04}), RoutingConfig()
    items = [e.mitigation for e in in_convention(SUGGESTED, loss, routing)]
    assert items == [
        "mismatch_token_clip_max=2",
        "rollout_correction=token_mask:0.5:2",
        "delta=3",
        "kl_coef=0",
        "advantage_clip=1",
    ]
    for item in items:
        apply_config(parse_mitigation_args([item]), loss, routing)  # each runs on the snapshot's config


def test_other_conventions_suggestions_are_left_as_they_are() -> None:
    for convention in ("axrl", "verl"):
        got = in_convention(SUGGESTED, LossConfig(convention=convention), RoutingConfig())
        assert got == SUGGESTED
