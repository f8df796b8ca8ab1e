"""Negative advantages that outweigh the positive ones by the magnitude of a few samples, not by their count: the
user is told those samples' advantages are the cause, the sign balance their symptom. Genuine reference-trainer runs
diagnosed as the benchmark diagnoses them (`diagnose_snapshot(model="auto")` on the burst's largest spike):
held-out IX's length penalty meant per thousand tokens applied per token on rank 2 of four (every reward there about
-4, the others' in [0, 1]) and on rank 1 of qwen2_moe, and a fault of no held-out set, two samples of rank 0 whose
rewards come back 100 times too large and negative (qwen2_moe). Held-out VII's baseline all-reduced as a sum on
rank 2 (every advantage there below 0, of an ordinary size) stays the sign balance. The rule was written after seeing
the IX misses: those cases are no longer held out."""

from __future__ import annotations

from pathlib import Path

import pytest
from captured_cases import diagnosed_case

from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.testing.fault_matrix import MatrixCase, matrix_cases


def _case(provenance: str, name: str) -> MatrixCase:
    [case] = [c for c in matrix_cases((provenance,)) if c.name == f"{provenance}:{name}"]
    return case


@pytest.mark.slow
def test_a_length_penalty_applied_per_token_leads_as_outlier_advantages_on_its_rank(tmp_path: Path) -> None:
    d = diagnosed_case(_case("held_out_ix", "reward_length_penalty_per_token_ws4"), tmp_path)
    assert d.top.family == "outlier_advantage" and d.top.ranks == [2] and d.top.strength >= 0.8, d.top
    assert "negative_advantage_dominance is its symptom" in d.top.evidence[0]
    for cause in d.causes:
        if cause.family == "negative_advantage_dominance":
            assert cause.strength < 0.8 and "concentrated" in cause.figures, cause
            assert any("not spread over many negative samples" in line for line in cause.evidence)
    assert any(m in d.mitigation_items() for m in ("drop_ranks=2", "advantage_clip=1"))


@pytest.mark.slow
@pytest.mark.matrix  # a capture on qwen2_moe or olmoe: the per-architecture matrix, run on request
def test_on_qwen2_moe_the_penalised_rank_leads_though_the_rest_leans_negative_too(tmp_path: Path) -> None:
    """Rank 1 of two (every reward there about -16): the other rank's small advantages lean negative as well, so
    the sign balance is judged on them alone, under 0.8."""
    d = diagnosed_case(_case("held_out_ix", "qwen2_moe_reward_length_penalty_per_token"), tmp_path)
    assert d.top.family == "outlier_advantage" and d.top.ranks == [1] and d.top.strength >= 0.8, d.top
    assert all(c.strength < 0.8 for c in d.causes if c.family == "negative_advantage_dominance"), d.causes


@pytest.mark.slow
@pytest.mark.matrix  # a capture on qwen2_moe or olmoe: the per-architecture matrix, run on request
def test_a_few_rewards_on_another_scale_lead_as_outliers_not_as_a_sign_balance(tmp_path: Path) -> None:
    fault = FaultSpec("reward_scale", ranks=(0,), samples=(1, 5), params={"factor": -100.0, "offset": -100.0})
    case = MatrixCase(
        "story:rewards_x-100", "outlier_advantage", "reinforce_baseline", "held_out", (fault,), model="qwen2_moe"
    )
    d = diagnosed_case(case, tmp_path)
    assert d.top.family == "outlier_advantage" and d.top.ranks == [0] and d.top.strength >= 0.8, d.top
    assert all(c.strength < 0.8 for c in d.causes if c.family == "negative_advantage_dominance"), d.causes


@pytest.mark.slow
def test_a_rank_wide_offset_of_ordinary_size_stays_the_sign_balance(tmp_path: Path) -> None:
    d = diagnosed_case(_case("held_out_vii", "baseline_all_reduced_sum_ws4"), tmp_path)
    assert d.top.family == "negative_advantage_dominance" and d.top.ranks == [2], d.top
    assert "concentrated" not in d.top.figures
