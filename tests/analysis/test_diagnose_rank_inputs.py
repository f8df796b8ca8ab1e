"""Per-rank comparisons of what each rank fed its loss (`diagnosis.rank_inputs`), on hand-edited copies of the golden
snapshot, the model evidence off: a rank whose loss masks start before every other rank's, a rank whose advantages
are on another scale than the others'. Alike on every rank, neither singles a rank out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from snapshot_edits import copy_fixture, edit_batch, no_mismatch

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot


def _mask_from_position_one(batch: dict[str, torch.Tensor]) -> None:
    batch["loss_mask"][:, 1:] = 1.0  # the attention mask, not the response mask: the prompt is trained on


def test_a_rank_whose_loss_masks_start_before_every_other_ranks_is_a_misaligned_mask_there(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, _mask_from_position_one)
    d = diagnose_snapshot(snapshot, model="never")
    [cause] = [c for c in d.causes if c.family == "mask_misalignment"]
    assert cause.ranks == [1] and cause.title == "loss mask starts early on rank 1"
    assert cause.figures["leading"] == {1: 1.0}
    assert "on 100 % of samples the loss mask starts before any other rank's" in cause.evidence[0]
    assert [e.mitigation for e in cause.experiments] == ["drop_ranks=1"]
    assert not any(c.family == "one_rank_data" and c.ranks == [1] for c in d.causes)


def test_masks_that_start_early_on_every_rank_single_no_rank_out(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    for rank in (0, 1):
        edit_batch(snapshot, rank, _mask_from_position_one)
    d = diagnose_snapshot(snapshot, model="never")
    assert not any(c.title.startswith("loss mask starts early") for c in d.causes)


def test_a_rank_whose_advantages_are_on_another_scale_names_its_advantages(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 0, lambda b: b.__setitem__("advantages", b["advantages"] * 50.0))
    d = diagnose_snapshot(snapshot, model="never")
    [cause] = [c for c in d.causes if c.title.startswith("advantages on another scale")]
    assert cause.family == "outlier_advantage" and cause.ranks == [0] and cause.term == "policy"
    assert "rank 0's typical |advantage|" in cause.evidence[0] and "x the other ranks' median" in cause.evidence[0]
    clip, drop = (e.mitigation for e in cause.experiments)
    assert clip.startswith("advantage_clip=") and drop == "drop_ranks=0"
    assert not any(c.family == "one_rank_data" and c.ranks == [0] for c in d.causes)


def test_advantages_a_few_times_the_other_ranks_are_no_other_scale(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 0, lambda b: b.__setitem__("advantages", b["advantages"] * 2.0))
    d = diagnose_snapshot(snapshot, model="never")
    assert not any(c.title.startswith("advantages on another scale") for c in d.causes)


def _summed(factor: float) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda b: b.__setitem__("advantages", b["advantages"] * factor)


def test_advantages_wider_than_their_rewards_explain_name_the_rank_with_no_rank_as_witness(tmp_path: Path) -> None:
    """Rank 0's GRPO advantages summed over the 14 positions; rank 1's groups all tied (advantages 0): no other
    rank's scale to compare with, but no usual estimator makes a spread of 14 from those rewards."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 0, _summed(14.0))
    edit_batch(snapshot, 1, lambda b: b.__setitem__("advantages", torch.zeros_like(b["advantages"])))
    d = diagnose_snapshot(snapshot, model="never")
    assert not any(c.title.startswith("advantages on another scale") for c in d.causes)
    [cause] = [c for c in d.causes if c.title.startswith("advantages wider than their rewards explain")]
    assert cause.family == "outlier_advantage" and cause.ranks == [0] and cause.term == "policy"
    assert abs(cause.figures["advantage_spread"][0] - 14.0) < 1e-3
    assert "in 1 of its 1 groups whose advantages differ" in cause.evidence[0]
    assert [e.mitigation for e in cause.experiments] == ["advantage_clip=1.73", "drop_ranks=0"]


def test_advantages_as_grpo_or_a_baseline_make_them_from_the_rewards_name_nothing(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 0, _summed(2.0))  # a Bessel or RLOO factor is far below SPREAD

    def baseline(b: dict[str, torch.Tensor]) -> None:  # rewards on a percent scale, a running baseline of 3
        b["rewards"] = b["rewards"] * 100.0
        b["advantages"] = b["rewards"] - 3.0

    edit_batch(snapshot, 1, baseline)
    d = diagnose_snapshot(snapshot, model="never")
    assert not any(c.title.startswith("advantages wider than their rewards explain") for c in d.causes)
