"""A step made non-finite by the trainer (a division by zero), not by a log-prob whose distance overflows exp(): the
user is not sent to clamp the log-ratio, an experiment that would change nothing. Genuine reference-trainer runs
diagnosed as the benchmark diagnoses them (`diagnose_snapshot(model="auto")` on the burst's largest spike):
held-out IX's gradient accumulation divided by the micro-batch count less one on rank 1 (one micro-batch: 1/0), and
the same bug on another model and rank (qwen2_moe, rank 0). The overflow rule's own stories
(`test_diagnose_overflow_driver`) keep the clamp where a log-prob drives the overflow. The rule was written after
seeing the IX miss: that case is no longer held out."""

from __future__ import annotations

from pathlib import Path

import pytest
from captured_cases import diagnosed_case

from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.diagnosis.diagnose import Diagnosis
from axrl_spike_replay.testing.fault_matrix import MatrixCase, matrix_cases


def _assert_no_clamp(d: Diagnosis) -> None:
    [cause] = [c for c in d.causes if c.family == "non_finite"]
    offered = [e.mitigation for e in cause.experiments]
    assert not any(m.startswith("log_ratio_clip=") for m in offered), offered
    assert not any(m.startswith("log_ratio_clip=") for m in d.mitigation_items()), d.mitigation_items()


@pytest.mark.slow
def test_a_division_by_zero_in_the_trainer_is_not_sent_to_the_log_ratio_clamp(tmp_path: Path) -> None:
    [case] = [c for c in matrix_cases(("held_out_ix",)) if c.name == "held_out_ix:grad_accumulation_off_by_one"]
    _assert_no_clamp(diagnosed_case(case, tmp_path))


@pytest.mark.slow
@pytest.mark.matrix  # a capture on qwen2_moe or olmoe: the per-architecture matrix, run on request
def test_a_division_by_zero_on_another_model_and_rank_is_not_sent_to_the_clamp_either(tmp_path: Path) -> None:
    """The same trainer bug on qwen2_moe's rank 0 (the IX case has it on tiny_moe's last rank)."""
    fault = FaultSpec("grad_accumulation_off_by_one", ranks=(0,))
    case = MatrixCase("story:accumulation_by_zero", "non_finite", "peaked", "held_out", (fault,), model="qwen2_moe")
    _assert_no_clamp(diagnosed_case(case, tmp_path))
