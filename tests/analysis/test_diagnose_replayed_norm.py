"""When `diagnose` replays the step for its attribution, the replayed grad norm against the recorded one is a
consistency check: a snapshot whose batch was edited after the fact does not reproduce, and says so by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from snapshot_edits import copy_fixture, edit_batch, no_mismatch

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot, render_diagnosis
from axrl_spike_replay.diagnosis.task_entry import diagnosis_entry
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.vocabulary import Verb

RECORDED = 56.77506102151846  # the fixture's recorded grad norm


def test_a_batch_edited_after_the_fact_does_not_reproduce_and_is_named(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, lambda b: b["advantages"].__setitem__(3, b["advantages"][3] * 200.0))
    d = diagnose_snapshot(snapshot, model="always")
    assert d.consistency is not None
    assert "grad_norm_vs_replay" in d.consistency.checked
    (problem,) = [p for p in d.consistency.problems if p.name == "grad_norm_vs_replay"]
    assert problem.figures["recorded_grad_norm"] == pytest.approx(RECORDED)
    assert problem.figures["replayed_grad_norm"] == pytest.approx(20.99, abs=0.01)
    assert problem.figures["rel_diff"] > problem.figures["tolerance"] == 1e-5
    assert "the snapshot does not reproduce" in problem.message and "batch or weights differ" in problem.message
    assert d.consistency.self_consistent is False  # it said "agrees with itself"
    assert "agrees with itself" not in d.consistency.summary()
    assert "problem [grad_norm_vs_replay]: the snapshot does not reproduce" in render_diagnosis(d)
    entry = diagnosis_entry(d, "always")  # what the task and the report keep
    assert entry["consistency"]["self_consistent"] is False
    names = [p["name"] for p in entry["consistency"]["problems"]]
    assert names[0] == "grad_norm_vs_replay"
    # both ranks' batches were edited (no_mismatch rewrites each rank's rollout log-probs), so each rank's recorded
    # loss and per-parameter norms disagree with its replay too, and the per-rank checks name them
    ranks = [p.figures["rank"] for p in d.consistency.problems if p.name == "rank_loss_vs_replay"]
    assert names[1 : 1 + len(ranks)] == ["rank_loss_vs_replay"] * len(ranks) and sorted(ranks) == [0, 1]
    assert names[1 + len(ranks) :] == ["param_grad_norms_vs_replay"] * 2
    # the diagnosis explains it first: both ranks' records differ from the replay, neither by a scale
    assert d.top.family == "step_not_reproduced" and d.top.figures["matching_ranks"] == []


def test_the_unedited_snapshot_reproduces_and_an_attribution_under_mitigations_is_not_compared(
    tmp_path: Path,
) -> None:
    snapshot = copy_fixture(tmp_path)
    d = diagnose_snapshot(snapshot, model="always")
    assert d.consistency is not None and "grad_norm_vs_replay" in d.consistency.checked
    assert d.consistency.problems == [] and d.consistency.self_consistent is True

    clipped = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=3, mitigations={"advantage_clip": 0.5}))
    )
    d = diagnose_snapshot(snapshot, attribution=clipped, model="never")
    assert d.consistency is not None and "grad_norm_vs_replay" not in d.consistency.checked
    assert any(n.startswith("grad_norm_vs_replay (the attribution ran under mitigations") for n in d.not_checked)

    # a GPU attribution is judged with the GPU tolerance: a 5e-5 difference is float noise there, not on the CPU
    plain = attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=3)))
    off = dataclasses.replace(plain, grad_norm=plain.recorded_grad_norm * (1 + 5e-5))
    on_cpu = diagnose_snapshot(snapshot, attribution=off, model="never").consistency
    on_gpu = diagnose_snapshot(snapshot, attribution=dataclasses.replace(off, device="cuda"), model="never").consistency
    assert on_cpu is not None and [p.name for p in on_cpu.problems] == ["grad_norm_vs_replay"]
    assert on_gpu is not None and on_gpu.problems == []
