"""A loss mask that covers positions the rank's engine recorded no route for (padding after the response stopped),
where the other rank's covers none, is a mask misaligned on that rank (`rank_inputs.mask_over_unrecorded`)."""

from __future__ import annotations

from pathlib import Path

import torch
from snapshot_edits import copy_fixture, no_mismatch

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot

TITLE = "loss mask covers positions the engine did not generate"


def unroute_tail(snapshot: Path, rank: int, tail: int) -> None:
    """Rank `rank`'s routing payload: no route (-1) at the last `tail` positions of every sample, which its loss
    mask still covers."""
    path = snapshot / f"routing_payload_rank{rank}.pt"
    doc = torch.load(path, weights_only=True)
    routes = doc["routed_experts"].clone()
    routes[:, -tail:] = -1
    doc["routed_experts"] = routes
    torch.save(doc, path)
    mask = torch.load(snapshot / f"batch_rank{rank}.pt", weights_only=True)["loss_mask"]
    assert bool(mask[:, -tail:].ne(0).all()), "the fixture's loss covers the last positions"


def test_a_mask_over_positions_one_ranks_engine_never_routed_names_that_rank(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    unroute_tail(snapshot, 1, 3)
    d = diagnose_snapshot(snapshot, model="never")
    cause = next(c for c in d.causes if c.family == "mask_misalignment" and TITLE in c.title)
    assert cause.ranks == [1] and cause.title.endswith("rank 1")
    share = cause.figures["unrecorded_loss_share"][1]
    mask = torch.load(snapshot / "batch_rank1.pt", weights_only=True)["loss_mask"] != 0
    assert share == int(mask[:, -3:].sum()) / int(mask.sum())
    assert "0 % at most on the other ranks" in cause.evidence[0]
    assert [e.mitigation for e in cause.experiments] == ["drop_ranks=1"]


def test_no_witness_or_no_unrouted_loss_token_names_nothing(tmp_path: Path) -> None:
    clean = copy_fixture(tmp_path / "clean")
    no_mismatch(clean)
    both = copy_fixture(tmp_path / "both")
    no_mismatch(both)
    for rank in (0, 1):
        unroute_tail(both, rank, 3)
    for snapshot in (clean, both):
        d = diagnose_snapshot(snapshot, model="never")
        assert not [c for c in d.causes if TITLE in c.title]
