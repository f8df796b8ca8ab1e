"""Snapshots the verl hook writes: under FSDP each rank records its shard's norms, which merge over the ranks."""

from __future__ import annotations

from pathlib import Path

import torch

from axrl_spike_replay.snapshot.consistency import check_snapshot


def test_fsdp_shard_norms_merge_over_the_ranks(tmp_path: Path) -> None:
    from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot

    snapshot = write_synthetic_snapshot(tmp_path, SyntheticSpec(world_size=2, grad_norm=40.0))
    for rank, norm in ((0, 24.0), (1, 32.0)):  # each rank's shard of the reduced gradient: sqrt(24^2 + 32^2) = 40
        info = {"grad_norm": 40.0, "param_grad_norms": {"w": norm}, "param_grad_norms_kind": "reduced_shard"}
        torch.save(info, snapshot / f"grad_info_rank{rank}.pt")
    assert check_snapshot(snapshot).self_consistent
    for rank in (0, 1):  # read as local gradients before the DP mean, their mean's norm could be 28 at most
        info = torch.load(snapshot / f"grad_info_rank{rank}.pt", weights_only=True)
        del info["param_grad_norms_kind"]
        torch.save(info, snapshot / f"grad_info_rank{rank}.pt")
    assert [p.name for p in check_snapshot(snapshot).problems] == ["grad_norm_vs_param_norms"]
