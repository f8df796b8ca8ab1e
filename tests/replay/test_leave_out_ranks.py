"""`drop_ranks` / `keep_ranks` leave a saved rank out whole: its samples leave the policy and KL terms, and its
batch-level router losses (aux, z) leave the step too. A left-out rank's batch replaced by random tokens leaves the
replay and the loss channel unchanged, to the bit (tests/leave_out_check.py); on the reference model here, on every
transformers architecture in the `matrix` (tests/models/test_hf_leave_out.py) and on Megatron-core's
(tests/megatron/test_megatron_leave_out.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from leave_out_check import check_leave_out_invariance


@pytest.mark.slow
def test_a_left_out_rank_contributes_nothing_router_terms_included(spike_snapshot: Path, tmp_path: Path) -> None:
    check_leave_out_invariance(spike_snapshot, tmp_path)


@pytest.mark.slow
@pytest.mark.matrix
def test_a_left_out_rank_contributes_nothing_with_the_policy_sharded(spike_snapshot: Path, tmp_path: Path) -> None:
    check_leave_out_invariance(spike_snapshot, tmp_path, nproc=2, shard="on")


def test_a_left_out_rank_is_marked_and_its_loss_is_nothing(spike_snapshot: Path) -> None:
    result = run_replay(replay_request(What(spike_snapshot, mitigations={"drop_ranks": "1"}), how=How(nproc=1)))
    left = [m for m in result.rank_metrics if m["rank"] == 1]
    assert left and left[0]["left_out"] is True and left[0]["loss"] == 0.0 and left[0]["loss_tokens"] == 0.0
    assert not result.rank_metrics[0].get("left_out")
    assert result.footprint is not None and result.footprint.masked_tokens > 0  # its tokens count as masked
    assert torch.isfinite(torch.tensor(result.grad_norm))
