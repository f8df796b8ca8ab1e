"""Every cause is held to the per-rank figures: when a rank's local grad norm (or its record against the replay, or
a stored signal with a witness) singles it out, a cause of a rank's own broken part is scoped to it, and a cause
that claims every rank says why and is weakened below the scoped ones; tied causes name the comparison that would
separate them."""

from __future__ import annotations

from types import SimpleNamespace

from axrl_spike_replay.diagnosis.rules.causes import Cause, Experiment
from axrl_spike_replay.diagnosis.rules.causes_by_rank import UNSCOPED, Singled, hold_to_ranks, singled_out
from axrl_spike_replay.diagnosis.rules.tie_break import name_comparisons


def local_norms(*norms: float) -> SimpleNamespace:
    """Evidence whose per-rank grad info has these local norms (nothing else read)."""
    ranks = [SimpleNamespace(rank=r, local_grad_norm=n) for r, n in enumerate(norms)]
    return SimpleNamespace(grads=SimpleNamespace(ranks=ranks), reproduction=None, reading=None, channel=None)


def test_a_rank_whose_local_norm_is_200x_the_others_is_singled_out_and_none_when_all_are_alike() -> None:
    found = singled_out(local_norms(0.25, 0.25, 50.0, 0.25), world=4)
    assert found.ranks == [2] and "200x" in found.figures[0]
    assert singled_out(local_norms(1.0, 1.2, 0.9, 1.1), world=4).ranks == []


def test_a_cause_claiming_every_rank_against_figures_that_show_one_is_scoped_or_weakened() -> None:
    stale = Cause("stale_old_logprobs", "stale old log-probs on every rank", 0.6)
    engine = Cause("engine_mismatch", "engine/trainer mismatch", 0.9)
    right = Cause("one_rank_data", "rank 2's data", 0.6, ranks=[2])
    wrong_rank = Cause("routing_payload", "rank 0's routes", 0.8, ranks=[0])
    wide = Cause("bad_ref_logprobs", "reference on ranks 1, 2", 1.0, ranks=[1, 2])
    hold_to_ranks([stale, engine, right, wrong_rank, wide], singled_out(local_norms(0.25, 0.25, 50.0, 0.25), world=4))
    assert wide.ranks == [2] and "not rank 1" in wide.evidence[-1]
    assert stale.ranks == [2] and stale.strength == 0.6 and "scoped to rank 2" in stale.evidence[-1]
    assert engine.ranks == [] and engine.strength == UNSCOPED and "claims every rank" in engine.evidence[-1]
    assert right.strength == 0.6 and right.evidence == []
    assert wrong_rank.strength == UNSCOPED and "claims ranks 0" in wrong_rank.evidence[-1]
    untouched = Cause("engine_mismatch", "engine/trainer mismatch", 0.9)
    hold_to_ranks([untouched], Singled())
    assert untouched.strength == 0.9 and untouched.evidence == []


def test_tied_causes_name_the_comparison_that_separates_them() -> None:
    a = Cause("stale_old_logprobs", "old", 0.7, experiments=[Experiment("recompute=old_logprobs:rank2", "")],
              tied_with=["one_rank_data"])  # fmt: skip
    b = Cause(
        "one_rank_data", "data", 0.7, experiments=[Experiment("drop_ranks=2", "")], tied_with=["stale_old_logprobs"]
    )
    assert name_comparisons([a, b]) == [(a, b)]
    assert "replay `recompute=old_logprobs:rank2` against `drop_ranks=2`" in a.evidence[-1] == b.evidence[-1]


def test_diagnose_runs_the_comparison_of_tied_causes_and_separates_them(tmp_path) -> None:
    """One sweep beside the baseline on a copy of the golden snapshot: dropping rank 1 moves the spike, an advantage
    clip far beyond every advantage does not; the first cause gets back its strength, the other says why not."""
    from snapshot_edits import copy_fixture

    from axrl_spike_replay.diagnosis.rules.tie_break import run_comparisons

    snapshot = copy_fixture(tmp_path)
    a = Cause("one_rank_data", "rank 1's data", 0.7, experiments=[Experiment("drop_ranks=1", "")], tied_with=["x"])
    b = Cause("outlier_advantage", "outliers", 0.7, experiments=[Experiment("advantage_clip=1000", "")],
              tied_with=["one_rank_data"])  # fmt: skip
    a.tied_with = ["outlier_advantage"]
    assert run_comparisons(snapshot, [(a, b)], {id(a): 0.9, id(b): 0.8}) == []
    assert a.strength == 0.9 and a.tied_with == [] and "the spike answers to this cause" in a.evidence[-1]
    assert b.strength == 0.7 and "the spike answers to one_rank_data" in b.evidence[-1]


def test_on_a_real_snapshot_whose_figures_single_out_one_rank_no_strong_cause_claims_every_rank(tmp_path) -> None:
    """The issue's rule end to end: rank 1's stored old log-probs stale on a copy of the golden snapshot (its step
    recorded as trained), so the per-rank figures single out rank 1; every cause at strength >= 0.8 then names rank 1
    and no other, and none claims every rank."""
    from snapshot_edits import copy_fixture, diagnosed, no_mismatch, set_loss, stale_old_logprobs

    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    set_loss(snapshot, is_base_logprobs="old")
    stale_old_logprobs(snapshot, 1)
    d = diagnosed(snapshot, model="always")
    assert d.reading is not None
    odd = d.reading.odd_signal("old")
    assert odd is not None and odd.ranks == [1] and odd.separated  # a figure that singles out rank 1
    strong = [c for c in d.causes if c.strength >= 0.8]
    assert strong and d.top.family == "stale_old_logprobs"
    assert all(c.ranks == [1] or (c.family == "step_not_reproduced" and 1 in c.ranks) for c in strong), [
        (c.family, c.strength, c.ranks) for c in strong
    ]


def test_two_witnessed_causes_on_the_same_rank_tie_until_a_comparison_separates_them() -> None:
    """Two stored inputs off on one rank, each with its witness, are more often one fault upstream of both than two:
    neither is called certain before the comparison that separates them. On different ranks, or beside a failed
    input check (a fact about the snapshot), they stay two broken parts."""
    from axrl_spike_replay.diagnosis.diagnose import TIED, mark_ties

    def witnessed(family: str, ranks: list[int], **figures: object) -> Cause:
        return Cause(family, family, 1.0, figures=dict(figures), ranks=ranks)

    old, ref = witnessed("stale_old_logprobs", [1]), witnessed("bad_ref_logprobs", [1])
    mark_ties([old, ref])
    assert old.tied_with == ["bad_ref_logprobs"] and ref.tied_with == ["stale_old_logprobs"]
    assert old.strength == ref.strength == TIED < 0.8

    apart = [witnessed("stale_old_logprobs", [0]), witnessed("bad_ref_logprobs", [3])]
    mark_ties(apart)
    assert all(c.strength == 1.0 and not c.tied_with for c in apart)

    checked = witnessed("mask_misalignment", [1], input_findings=[{"check": "mask_values"}])
    signal = witnessed("stale_old_logprobs", [1])
    mark_ties([checked, signal])
    assert checked.strength == signal.strength == 1.0

    routes, moved = witnessed("routing_payload", [1]), witnessed("bad_ref_logprobs", [1])
    mark_ties([routes, moved])  # the routes rule reads the moved signal as their symptom instead
    assert not routes.tied_with and not moved.tied_with
