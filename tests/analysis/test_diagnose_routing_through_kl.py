"""The issue's first spike, as a run of the reference trainer: one DP rank's routing payload is corrupt (a stale
expert-id table on most of its tokens), the old log-probs are taken under the same replayed routes (so the PPO ratio
is 1 and the old/rollout comparison alone points at a log-prob mismatch), and the reference worker routes on its
own. The k3 KL term, not the PPO ratio, carries the gradient. `diagnose` must name the routing payload on that rank
first, say the KL term carries it, and suggest the KL levers and the rank drop, not a log-prob mismatch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from axrl_spike_replay.capture.fault_injection.faults import make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.testing.fault_matrix import burst_snapshots


@pytest.mark.slow
def test_a_corrupt_routing_payload_on_one_rank_carried_by_the_kl_term_is_named_with_its_rank_and_channel(
    tmp_path: Path,
) -> None:
    faults = [
        make_fault(FaultSpec("routes_stale_layer", ranks=(1,), params={"fraction": 0.7})),
        make_fault(FaultSpec("ref_own_routing")),  # every rank's reference worker routes on its own
    ]
    run = capture_reference_run(
        tmp_path,
        run="routes-through-kl",
        world_size=2,
        steps=24,
        preset="expert_sensitive",
        faults=faults,
        hide_fault=True,
        overrides={"loss": {"kl_coef": 0.1, "kl_estimator": "k3", "is_base_logprobs": "old"}},
    )
    # the burst's largest finite spike: the routes can also drive a later step to NaN on some machines' arithmetic,
    # and a non-finite step is diagnosed as non-finite, whatever drove it there
    snapshots = [p for p in burst_snapshots(run, "expert_sensitive") if math.isfinite(read_metadata(p)[0].spike_ratio)]
    assert snapshots, f"no finite spike at the burst: {run.grad_norms}"
    d = diagnose_snapshot(snapshots[0], model="always")

    assert d.step is not None
    rank0, rank1 = d.step.signals.rank(0), d.step.signals.rank(1)
    assert rank0 is not None and rank1 is not None
    agreement = {r.rank: 1.0 - (r.route_disagreement() or 0.0) for r in (rank0, rank1)}
    assert agreement[0] > 0.95 and agreement[1] < 0.5  # as in the issue: ~1.0 on one rank, ~0.3 on the other

    top = d.top
    assert top.family == "routing_payload" and top.ranks == [1] and top.strength == 1.0
    assert top.term == "kl"
    channel = d.step.channel
    assert channel is not None and channel.carrier is not None and channel.carrier.term == "kl"
    kl = channel.term("kl")
    assert kl is not None and kl.share > 0.9 and all(t["rank"] == 1 for t in kl.top_tokens)
    # the stored old log-probs were taken under the same routes: they agree with the replay, no mismatch is named
    assert not {"engine_mismatch", "stale_old_logprobs"} & {c.family for c in d.causes if c.strength >= 0.3}
    assert d.causes[0].family not in ("engine_mismatch", "stale_old_logprobs", "non_finite")
    # the reference differs on rank 1 too (the replay runs the corrupt routes there): the routes' symptom, not certain
    assert [c.family for c in d.causes if c.strength >= 0.8] == ["routing_payload"]

    items = d.mitigation_items()
    assert "drop_ranks=1" in items
    assert {"kl_estimator=k2", "kl_clamp=10"} <= set(items)
    assert items[0] == "recompute=routes:rank1,old_logprobs:rank1"
    for item in items:
        parse_mitigation_args([item])


@pytest.mark.slow
def test_routes_off_on_few_tokens_that_make_one_ranks_data_far_less_likely_are_the_routing_payload(
    tmp_path: Path,
) -> None:
    """A stale expert-id table on a tenth of one rank's tokens: its routes differ on fewer tokens than count as
    clearly off, but on an expert-sensitive policy they cost that rank's samples over a nat per token against the
    model's own routing (nothing on the other rank). That is the payload, not that rank's data."""
    run = capture_reference_run(
        tmp_path,
        run="few-stale-routes",
        world_size=2,
        steps=24,
        preset="expert_sensitive",
        faults=[make_fault(FaultSpec("routes_stale_layer", ranks=(1,), params={"fraction": 0.1}))],
        hide_fault=True,
    )
    # the burst's largest finite spike: the routes can also drive a later step to NaN on some machines' arithmetic,
    # and a non-finite step is diagnosed as non-finite, whatever drove it there
    snapshots = [p for p in burst_snapshots(run, "expert_sensitive") if math.isfinite(read_metadata(p)[0].spike_ratio)]
    assert snapshots, f"no finite spike at the burst: {run.grad_norms}"
    d = diagnose_snapshot(snapshots[0], model="always")
    assert d.reading is not None
    assert d.reading.routes[1] < 1.0 and d.reading.routes[0] < 0.1  # under the clearly-off share of tokens
    top = d.top
    assert top.family == "routing_payload" and top.ranks == [1] and top.strength == 1.0
    assert any("less likely under its recorded routes than under the model's own routing" in x for x in top.evidence)
    assert "one_rank_data" not in {c.family for c in d.causes if c.strength >= 0.3}
    assert "drop_ranks=1" in d.mitigation_items()
