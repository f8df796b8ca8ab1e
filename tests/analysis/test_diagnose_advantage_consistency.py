"""Each rank's stored advantages held to its own stored rewards under the estimator the run config records
(`diagnosis.rules.advantage_consistency`), on hand-edited copies of the golden snapshot (a GRPO run): advantages
made without the group mean are named on their rank with no other rank as a witness; the golden's own advantages,
a baseline run's and a run whose estimator is not recorded name nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from snapshot_edits import copy_fixture, diagnosed, edit_batch, no_mismatch

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.diagnosis.rules.advantage_consistency import inconsistent_ranks, recorded_estimator

TITLE = "advantages their own rewards do not give"


def _mean_not_subtracted(b: dict[str, Any]) -> None:
    """GRPO's standardisation without its centring (`r / (std + eps)`), group by group; the second group's rewards
    all tie (0.125), so its advantages are 0.125 / 1e-6."""
    b["rewards"][4:] = 0.125
    groups = b["rewards"].view(-1, 4)
    b["advantages"] = (groups / (groups.std(dim=-1, keepdim=True, unbiased=False) + 1e-6)).reshape(-1)


def _all_tied(b: dict[str, Any]) -> None:
    """Every group's rewards tie: GRPO gives every advantage 0 (no witness of any scale on this rank)."""
    b["rewards"] = torch.full_like(b["rewards"], 0.125)
    b["advantages"] = torch.zeros_like(b["advantages"])


def _set_train(snapshot: Path, **values: Any) -> None:
    path = snapshot / "run_config.yaml"
    doc = yaml.safe_load(path.read_text())
    for key, value in values.items():
        if value is None:
            doc["train"].pop(key, None)
        else:
            doc["train"][key] = value
    path.write_text(yaml.safe_dump(doc))


def test_advantages_made_without_the_group_mean_are_named_on_their_rank_with_no_other_rank_as_witness(
    tmp_path: Path,
) -> None:
    """Held-out VI's first miss, on the golden run: rank 1's advantages are its rewards over the group's std, rank
    0's all 0 (every group's rewards tie). No other rank's advantages give a scale to compare with, but the run's
    GRPO makes neither of rank 1's groups from its rewards: one is off centre by 1, the tied one by 125,000."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, _mean_not_subtracted)
    edit_batch(snapshot, 0, _all_tied)
    d = diagnose_snapshot(snapshot, model="never")
    assert not any(c.title.startswith("advantages on another scale") for c in d.causes)
    [cause] = [c for c in d.causes if c.title.startswith(TITLE)]
    assert cause.family == "outlier_advantage" and cause.ranks == [1] and cause.term == "policy"
    assert cause.title == f"{TITLE} on rank 1"
    assert cause.figures["estimator"] == "grpo" and cause.figures["groups"] == {1: 2}
    assert cause.figures["groups_failing"] == {1: 2}
    offsets = sorted(cause.figures["off_centre"][1])
    assert offsets[0] == pytest.approx(1.0, rel=1e-4) and offsets[1] == pytest.approx(125_000.0, rel=1e-4)
    line = cause.evidence[0]
    assert line.startswith("rank 1's advantages against its own rewards under the run's grpo estimator")
    assert "in 2 of its 2 groups the advantages' mean is not 0 (|mean| 1 to 1.25e+05)" in line
    assert "1 of them of equal rewards, whose advantages should all be 0, hold up to 1.25e+05" in line
    assert [e.mitigation for e in cause.experiments] == ["advantage_clip=1.73", "drop_ranks=1"]
    assert not any(c.family == "one_rank_data" and c.ranks == [1] for c in d.causes)


def test_with_the_model_the_uncentred_advantages_lead_at_the_strength_their_rank_carries(tmp_path: Path) -> None:
    """The same edit, the step recorded as trained on it and the model evidence on: rank 1 carries the gradient, so
    its advantages are the top cause at 0.9, on rank 1 alone; nothing names a natural spike."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, _mean_not_subtracted)
    edit_batch(snapshot, 0, _all_tied)
    d = diagnosed(snapshot, model="always")
    assert d.top.family == "outlier_advantage" and d.top.title == f"{TITLE} on rank 1"
    assert d.top.ranks == [1] and d.top.strength == pytest.approx(0.9)
    assert "rank 1's loss terms carry 1 of the gradient" in d.top.evidence
    assert all(c.family != "natural_spike" for c in d.causes)


def test_advantages_ordered_against_their_rewards_are_named_under_a_baseline_estimator(tmp_path: Path) -> None:
    """A baseline run (advantages reward minus a running mean: not centred per group, but in the rewards' order):
    rank 0's first group's advantages swapped between a sample of reward 0 and one of 0.125."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    _set_train(snapshot, advantage_estimator="reinforce_baseline")

    def baseline(b: dict[str, Any], swap: bool) -> None:
        b["advantages"] = b["rewards"] - 0.05
        if swap:
            b["advantages"][[0, 1]] = b["advantages"][[1, 0]]

    edit_batch(snapshot, 0, lambda b: baseline(b, True))
    edit_batch(snapshot, 1, lambda b: baseline(b, False))
    d = diagnose_snapshot(snapshot, model="never")
    [cause] = [c for c in d.causes if c.title.startswith(TITLE)]
    assert cause.ranks == [0] and cause.figures["estimator"] == "reinforce_baseline"
    assert cause.figures["off_centre"] == {0: []}  # a baseline does not centre a group: not judged
    assert cause.figures["disordered_pairs"] == {0: 3} and cause.figures["groups_failing"] == {0: 1}
    assert "in 1 of its 2 groups the advantages do not follow the rewards' order (3 pairs" in cause.evidence[0]


def test_the_golden_runs_own_advantages_and_a_baseline_runs_name_nothing(tmp_path: Path) -> None:
    """The golden snapshot as captured (GRPO), with the model evidence: every group centred and in order, so no
    rank is named, no cause says its advantages are not its rewards', and no reference is singled out by its KL
    term. Its ranks as a baseline run stores them (reward minus a running mean: every group off centre, which a
    baseline does not centre) name nothing either."""
    snapshot = copy_fixture(tmp_path)
    assert recorded_estimator(snapshot) == ("grpo", 4)
    d = diagnose_snapshot(snapshot, model="auto")
    assert d.step is not None
    assert not any(c.title.startswith(TITLE) for c in d.causes)
    assert inconsistent_ranks_of(d) == ("grpo", 4, {})
    # nor does its KL term single a reference out (its pull is alike on both ranks)
    assert not any(c.family == "bad_ref_logprobs" and (c.ranks or c.strength >= 0.8) for c in d.causes)
    assert not any("harder there than on any other rank" in line for c in d.causes for line in c.evidence)
    _set_train(snapshot, advantage_estimator="reinforce_baseline")
    edit_batch(snapshot, 1, lambda b: b.__setitem__("advantages", b["rewards"] - 0.05))
    edit_batch(snapshot, 0, lambda b: b.__setitem__("advantages", b["rewards"] - 0.05))
    assert not any(c.title.startswith(TITLE) for c in diagnose_snapshot(snapshot, model="never").causes)


def inconsistent_ranks_of(d: Any) -> tuple[str, int, dict[int, Any]]:
    """`inconsistent_ranks` of the diagnosed snapshot, on its batch analysis alone."""
    from axrl_spike_replay.analysis.batch_signals import analyze_snapshot
    from axrl_spike_replay.diagnosis.rules.causes import Evidence

    return inconsistent_ranks(Evidence(analyze_snapshot(d.snapshot), None, None, None, 2))


def test_an_estimator_the_run_config_does_not_record_and_groups_split_over_ranks_are_not_judged(
    tmp_path: Path,
) -> None:
    """The uncentred advantages of the first test, judged only where the run config says what made them and the
    groups are whole: without `train.advantage_estimator` nothing is named, and neither is a group whose id another
    rank holds too (a group split over ranks has a partial mean)."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, _mean_not_subtracted)
    edit_batch(snapshot, 0, _all_tied)
    _set_train(snapshot, advantage_estimator=None)
    assert recorded_estimator(snapshot) is None
    assert not any(c.title.startswith(TITLE) for c in diagnose_snapshot(snapshot, model="never").causes)
    _set_train(snapshot, advantage_estimator="grpo")
    edit_batch(snapshot, 1, lambda b: b.__setitem__("group_index", b["group_index"] - 2))  # rank 0's ids 0 and 1
    assert not any(c.title.startswith(TITLE) for c in diagnose_snapshot(snapshot, model="never").causes)


def test_advantages_off_centre_below_zero_on_a_rank_that_carries_the_gradient_join_the_negative_advantage_cause(
    tmp_path: Path,
) -> None:
    """Rank 1's GRPO advantages less 2 (every group off centre below 0, still in the rewards' order, every advantage
    there below 0), rank 0's all tied: advantages that lean negative are what negative-advantage dominance reads, and
    rank 1 tips the sign balance, so the finding joins that cause on rank 1 (one symptom, named once) with its
    evidence, instead of standing beside it as advantages their rewards do not give."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, lambda b: b.__setitem__("advantages", b["advantages"] - 2.0))
    edit_batch(snapshot, 0, _all_tied)
    d = diagnosed(snapshot, model="always")
    assert not [c for c in d.causes if c.family == "outlier_advantage"]
    [cause] = [c for c in d.causes if c.family == "negative_advantage_dominance"]
    assert cause.ranks == [1] and any(
        line.startswith("every advantage on rank 1 is below 0") for line in cause.evidence
    )
    assert any(TITLE in line for line in cause.evidence)
    assert any("the advantages lean negative" in line for line in cause.evidence)
