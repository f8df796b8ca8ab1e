"""The one_rank_data cause family on hand-edited copies of the golden snapshot: one rank's recorded local grad norm far
above the others', or one rank's samples carrying the attributed norm."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from snapshot_edits import copy_fixture, edit_batch, edit_grad_info, no_mismatch

from axrl_spike_replay.analysis.grad_info import top_param_grads
from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot


def _families(diagnosis) -> dict[str, float]:
    return {c.family: c.strength for c in diagnosis.causes}


def test_one_ranks_recorded_local_norm_far_above_the_others_names_that_rank(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    local = {k.rank: k.local_grad_norm for k in top_param_grads(snapshot).ranks}
    edit_grad_info(
        snapshot,
        1,
        lambda info: info.update(param_grad_norms={k: 12.0 * v for k, v in info["param_grad_norms"].items()}),
    )
    d = diagnose_snapshot(snapshot, model="never")
    cause = next(c for c in d.causes if c.family == "one_rank_data")
    assert cause.title == "one rank's data (rank 1)" and cause.figures == {"rank": 1}
    factor = 12.0 * local[1] / local[0]
    assert cause.strength == pytest.approx(min(0.6, 0.2 * math.log2(factor)))
    assert f"is {factor:.3g}x the other ranks' median" in cause.evidence[0]
    assert cause.ranks == [1]
    # without attribution there is no sample to name: only the whole rank is left out
    assert [e.mitigation for e in cause.experiments] == ["drop_ranks=1"]


def test_one_rank_stays_silent_on_balanced_ranks(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    assert "one_rank_data" not in _families(diagnose_snapshot(snapshot, model="never"))


@pytest.mark.slow
def test_one_ranks_samples_carrying_the_norm_name_that_rank_with_its_samples(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    # all of rank 0's advantages 8x (10x and beyond: a scale of its own, see test_diagnose_rank_inputs)
    edit_batch(snapshot, 0, lambda b: b.__setitem__("advantages", b["advantages"] * 8.0))
    d = diagnose_snapshot(snapshot, model="always")
    cause = next(c for c in d.causes if c.family == "one_rank_data")
    assert cause.figures == {"rank": 0} and cause.strength >= 0.7  # and every stored signal of rank 0 agrees
    assert "every stored signal of rank 0 agrees with the replay" in cause.evidence
    share = sum(s["share"] for s in d.attribution_top if s["rank"] == 0)
    assert any(line.startswith("rank 0's top samples carry") for line in cause.evidence)
    assert share > 0.8
    whole, item = [e.mitigation for e in cause.experiments]
    assert whole == "drop_ranks=0"
    assert item.startswith("drop_samples=0:") and all(p.startswith("0:") for p in item.split("=")[1].split(","))


def _kl_carried_by_rank_1(typical: dict[int, float], advantages: dict[int, float]):
    """Evidence as the replay reads it: rank 1's KL term carries 95 % of the gradient; the reference is off alike on
    both ranks (the policy's drift, unwitnessed); `typical` each rank's typical mean log π, `advantages` each rank's
    |advantage| (signs alternate over its 8 samples)."""
    from types import SimpleNamespace

    from axrl_spike_replay.diagnosis.evidence.signal_reading import OddSignal, SignalReading
    from axrl_spike_replay.diagnosis.rules.causes import Evidence
    from axrl_spike_replay.experiment.step_evidence import LossChannel, TermFigures, TermRank

    rows = [
        {"rank": r, "sample": i, "loss_tokens": 8, "advantage": (-1) ** i * advantages[r]}
        for r in (0, 1)
        for i in range(8)
    ]
    kl = TermFigures("kl", 0.01, 1.0, 1.0, ranks=[TermRank(0, 0.2, 0.05), TermRank(1, 0.9, 0.95)])
    reading = SignalReading(likelihood=typical, odd=[OddSignal("ref", [0, 1], {0: 15.0, 1: 16.0}, spread=True)])
    return Evidence(
        analysis=SimpleNamespace(samples={"rows": rows}),
        grads=None,
        attribution=None,
        routes=None,
        world_size=2,
        reading=reading,
        channel=LossChannel(grad_norm=1.0, terms=[kl]),
    )


def test_a_rank_fed_data_the_policy_finds_far_less_likely_is_one_ranks_data_despite_a_drifted_reference() -> None:
    from axrl_spike_replay.diagnosis.rules.signal_families.data_causes import one_rank_data

    cause = one_rank_data(_kl_carried_by_rank_1({0: -0.1, 1: -9.8}, {0: 0.5, 1: 0.5}))
    assert cause is not None and cause.ranks == [1] and cause.strength >= 0.7
    assert any("far less likely" in line for line in cause.evidence)
    assert any("ref off alike on every rank" in line for line in cause.evidence)  # the drift vetoes nothing


def test_hard_samples_that_landed_on_one_rank_whose_data_is_alike_the_others_are_not_that_ranks_data() -> None:
    from dataclasses import replace

    from axrl_spike_replay.diagnosis.rules.signal_families.data_causes import one_rank_data

    ev = _kl_carried_by_rank_1({0: -9.7, 1: -9.8}, {0: 0.5, 1: 0.5})
    assert ev.reading is not None
    ev = replace(ev, reading=replace(ev.reading, odd=[]))  # every stored signal agrees
    cause = one_rank_data(ev)
    assert cause is not None and cause.strength < 0.3  # reported, but not likely
    assert any("alike the other ranks'" in line for line in cause.evidence)
    # the same rank with advantages 4x the others' scale: what it was fed differs
    scaled = replace(ev, analysis=_kl_carried_by_rank_1({0: -9.7, 1: -9.8}, {0: 0.5, 1: 2.0}).analysis)
    cause = one_rank_data(scaled)
    assert cause is not None and cause.strength >= 0.7 and cause.ranks == [1]
    # ... 10x and above every advantage of the others, its data alike: the advantages are the broken part there
    from axrl_spike_replay.diagnosis.rules.rank_inputs import rank_advantage_scale

    other = replace(ev, analysis=_kl_carried_by_rank_1({0: -9.7, 1: -9.8}, {0: 0.5, 1: 5.0}).analysis)
    assert one_rank_data(other) is None
    cause = rank_advantage_scale(other)
    assert cause is not None and cause.family == "outlier_advantage" and cause.ranks == [1]
    assert cause.strength == 0.9  # rank 1's terms carry the gradient (the channel)
