"""A rank whose tokens sit one position off its stored log-probs, masks and routes: the user is told the batch is
misaligned on that rank, by how many positions, and that the stored inputs reading off there are its symptoms, not
broken each on its own. Genuine reference-trainer runs diagnosed as the benchmark diagnoses them
(`diagnose_snapshot(model="auto")` on the burst's largest spike): held-out IX's batch tokenized with the BOS twice
on rank 1 (tiny_moe), and the same fault on rank 2 of four (tiny_moe, another rank and world size). The rule was
written after seeing the IX misses: those cases are no longer held out."""

from __future__ import annotations

from pathlib import Path

import pytest
from captured_cases import diagnosed_case

from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.diagnosis.diagnose import Diagnosis
from axrl_spike_replay.testing.fault_matrix import MatrixCase, matrix_cases


def _assert_misaligned(d: Diagnosis, rank: int) -> None:
    assert d.top.family == "mask_misalignment" and d.top.ranks == [rank] and d.top.strength >= 0.8, d.top
    assert d.top.figures["offsets"] == {rank: 1}
    assert f"drop_ranks={rank}" in [e.mitigation for e in d.top.experiments]
    for cause in d.causes[1:]:
        assert cause.strength < 0.8, cause
        if cause.family in ("routing_payload", "stale_old_logprobs") and cause.ranks == [rank]:
            assert any("symptom of that offset" in line for line in cause.evidence), cause


@pytest.mark.slow
def test_a_batch_tokenized_with_the_bos_twice_is_named_misaligned_on_its_rank(tmp_path: Path) -> None:
    [case] = [c for c in matrix_cases(("held_out_ix",)) if c.name == "held_out_ix:tokens_double_bos"]
    _assert_misaligned(diagnosed_case(case, tmp_path), 1)


@pytest.mark.slow
def test_the_same_shift_on_another_rank_of_four_is_named_there(tmp_path: Path) -> None:
    fault = FaultSpec("tokens_double_bos", ranks=(2,))
    case = MatrixCase("story:double_bos_ws4", "mask_misalignment", "peaked", "held_out", (fault,), 4, "tiny_moe")
    _assert_misaligned(diagnosed_case(case, tmp_path), 2)
