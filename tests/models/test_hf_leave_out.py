"""The leave-out invariance (tests/leave_out_check.py) on every transformers MoE architecture, each with its own
router losses (aux, z): a left-out rank's batch replaced by random tokens leaves the replay and the loss channel
unchanged, to the bit. The reference model's row runs by default (tests/replay/test_leave_out_ranks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.models.architectures import ARCHITECTURES
from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot
from leave_out_check import check_leave_out_invariance


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_a_left_out_rank_contributes_nothing_on_each_architecture(architecture: str, tmp_path: Path) -> None:
    snapshot = record_hf_snapshot(tmp_path / "recorded", architecture, world_size=2)
    (tmp_path / "noise").mkdir()
    check_leave_out_invariance(snapshot, tmp_path / "noise")
