"""Negative-advantage dominance held to the ranks whose advantages tip the sign balance, and one rank's advantages
all far below 0 named once, as that dominance on that rank, not beside it as advantages on another scale.

Written after held-out VII's REINFORCE baseline of the all-reduced reward sum on rank 2 of four (every advantage
there about -2.5, the others' balanced): negative-advantage dominance claimed every rank at 1.0 while the per-rank
figures single out rank 2, and an advantage-scale reading of rank 2 stood beside it at 0.9. Not held out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from snapshot_edits import copy_fixture, diagnosed, edit_batch, no_mismatch

from axrl_spike_replay.diagnosis.rules.causes import tipping_ranks, tipping_samples


def _offset(b: dict[str, Any], by: float) -> None:
    b["advantages"] = b["advantages"] - by


def test_one_ranks_advantages_all_far_below_zero_are_named_once_on_that_rank(tmp_path: Path) -> None:
    """The golden snapshot with rank 1's advantages its GRPO advantages less 4 (every one of them below -2.5), rank
    0's balanced as they were: the top cause is negative-advantage dominance on rank 1, saying rank 1 tips the
    balance and that the scale reading is the same symptom; no advantage cause stands beside it at >= 0.8."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, lambda b: _offset(b, 4.0))
    d = diagnosed(snapshot, model="always")
    top = d.causes[0]
    assert top.family == "negative_advantage_dominance" and top.ranks == [1] and top.strength >= 0.8, top
    assert any(line.startswith("rank 1 tips the balance") for line in top.evidence)
    assert any(line.startswith("every advantage on rank 1 is below 0") for line in top.evidence)
    assert "drop_ranks=1" in [e.mitigation for e in top.experiments]
    beside = [c for c in d.causes[1:] if c.family == "outlier_advantage" and c.strength >= 0.8]
    assert not beside, [(c.family, c.strength, c.ranks) for c in beside]


def test_advantages_below_zero_on_every_rank_keep_the_balance_the_batchs(tmp_path: Path) -> None:
    """Every rank's advantages offset alike below 0: no few ranks tip the balance, so the cause names none."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    for rank in (0, 1):
        edit_batch(snapshot, rank, lambda b: _offset(b, 4.0))
    d = diagnosed(snapshot, model="always")
    found = next(c for c in d.causes if c.family == "negative_advantage_dominance")
    assert found.ranks == [] and not any("tips the balance" in line for line in found.evidence)


def _rows(advantages: dict[int, list[float]]) -> list[dict[str, Any]]:
    return [
        {"rank": r, "sample": i, "advantage": a, "loss_tokens": 8}
        for r, values in advantages.items()
        for i, a in enumerate(values)
    ]


def test_the_ranks_that_tip_the_sign_balance_are_the_fewest_whose_removal_leaves_it_balanced() -> None:
    """Held-out VII's advantages (rank 2's all -2.5, the others GRPO-like): rank 2 alone tips the balance, the rest at
    0.82x. A rank leaning negative by chance (rank 0, 6 of 8 below 0) is not named; two ranks alike far below 0 of four
    are; three of four are the batch's."""
    small = [0.06, -0.065, -0.065, 0.06, -0.065, -0.065, -0.065, -0.065]
    mixed = [-0.065, 0.06, 0.06, -0.065, 0.185, 0.06, -0.065, 0.185]
    ranks, rest = tipping_ranks(_rows({0: small, 1: mixed, 2: [-2.5] * 8, 3: mixed}))
    assert ranks == [2] and 0.5 < rest < 1.5
    assert tipping_ranks(_rows({0: small, 1: mixed, 2: [-2.5] * 8, 3: [-2.5] * 8}))[0] == [2, 3]
    assert tipping_ranks(_rows({0: [-2.5] * 8, 1: mixed, 2: [-2.5] * 8, 3: [-2.5] * 8})) == ([], 0.0)
    assert tipping_ranks(_rows({0: [-2.5] * 8})) == ([], 0.0)


def _three_far_below_zero(b: dict[str, Any]) -> None:
    b["advantages"] = b["advantages"].clone()
    b["advantages"][:3] = -6.0


def test_negative_dominance_on_one_rank_comes_with_a_lever_that_leaves_out_only_the_negatives_that_tip_it(
    tmp_path: Path,
) -> None:
    """Three of rank 1's samples with advantages far below 0 (-6): diagnose suggests leaving out only the fewest most
    negative samples of rank 1 that tip the balance, and the replay judges it (a verdict; the hand-edited step
    is no spike by the snapshot's detector, so its grad norm is what moves)."""
    from axrl_spike_replay.investigation.request import How, Verb, What, replay_request
    from axrl_spike_replay.replay.sweep import run_sweep

    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, _three_far_below_zero)
    d = diagnosed(snapshot, model="never")
    top = next(c for c in d.causes if c.family == "negative_advantage_dominance")
    assert top.ranks == [1], top
    [lever] = [e for e in top.experiments if e.mitigation.startswith("drop_samples=")]
    pairs = lever.mitigation.split("=")[1].split(",")
    assert pairs and set(pairs) <= {"1:0", "1:1", "1:2"}  # a few of rank 1's, not the rank
    assert lever.diagnostic_only and lever.mitigation in d.mitigation_items()
    what = What(snapshot, verb=Verb.SWEEP, configs=({"drop_samples": lever.mitigation.split("=")[1]},))
    sweep = run_sweep(replay_request(what, how=How(nproc=1)))
    [result] = sweep.results
    assert str(result.verdict) in {"cleared", "partial", "no_effect", "worse", "baseline_not_a_spike"}
    assert result.grad_norm is not None and sweep.baseline.grad_norm is not None
    assert result.grad_norm < sweep.baseline.grad_norm  # the negatives carried part of the step


def test_the_samples_that_tip_the_balance_are_the_fewest_most_negative_on_the_named_ranks() -> None:
    rows = _rows({0: [1.0, -1.0, 0.5, -0.5], 1: [-3.0, -2.5, -0.1, 0.2]})
    assert tipping_samples(rows, [1]) == [(1, 0), (1, 1)]
    assert tipping_samples(rows, []) == [(1, 0), (1, 1)]
    assert tipping_samples(_rows({0: [1.0, -1.0], 1: [0.5, -0.5]}), []) == []  # balanced: none to name
