"""The leave-out invariance (tests/leave_out_check.py) on the snapshot Megatron-core's own training wrote (route 1:
its checkpoint in the transformers policy, with Megatron's router losses): a left-out rank's batch replaced by random
tokens leaves the replay and the loss channel unchanged, to the bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from leave_out_check import check_leave_out_invariance


@pytest.mark.slow
@pytest.mark.matrix
def test_a_left_out_rank_contributes_nothing_on_megatron_core(megatron_capture: Path, tmp_path: Path) -> None:
    check_leave_out_invariance(megatron_capture, tmp_path)
