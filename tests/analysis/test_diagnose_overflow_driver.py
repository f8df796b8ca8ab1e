"""A step whose grad norm is not finite though every stored input is: the user is told which finite input's extreme
values overflow, and that input's cause leads, not "non-finite values" (the symptom). Genuine reference-trainer runs
of two faults diagnosed as the benchmark diagnoses them (`diagnose_snapshot(model="auto")` on the burst's largest
spike): held-out VIII's engine reporting each sequence's cumulative log-prob as each token's own on rank 1
(qwen2_moe, ratios against the engine's log-probs), and a fault of no held-out set, old log-probs on rank 1 stored 64
times too large (tiny_moe, ratios against the old log-probs). The rule was written after seeing the VIII miss: that
case is no longer held out."""

from __future__ import annotations

from pathlib import Path

import pytest
from captured_cases import diagnosed_case

from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.diagnosis.diagnose import Diagnosis
from axrl_spike_replay.diagnosis.rules.overflow import EXP_OVERFLOW
from axrl_spike_replay.testing.fault_matrix import MatrixCase, matrix_cases


def _assert_driver_leads(d: Diagnosis, family: str, signal: str) -> None:
    assert d.grad_norm != d.grad_norm or abs(d.grad_norm) == float("inf"), "the step should not be finite"
    assert d.top.family == family and d.top.ranks == [1] and d.top.strength >= 0.8, d.top
    [symptom] = [c for c in d.causes if c.family == "non_finite"]
    assert symptom.strength < d.top.strength and symptom.strength < 0.8, symptom
    overflow = symptom.figures["overflow"]
    assert overflow["signal"] == signal and list(overflow["peaks"]) == [1]
    assert overflow["peaks"][1] > EXP_OVERFLOW  # the finite input that overflows exp(), on the rank it is on
    assert any("symptom of that input" in line for line in symptom.evidence)
    assert any("drives the step's non-finite grad norm" in line for line in d.top.evidence)
    # the non-finite cause's experiments test the driver: its rank left out, and the clamp before exp()
    tests = {e.mitigation for e in symptom.experiments}
    assert {"drop_ranks=1", "log_ratio_clip=5"} <= tests


@pytest.mark.slow
@pytest.mark.matrix  # a capture on qwen2_moe or olmoe: the per-architecture matrix, run on request
def test_an_engine_reporting_cumulative_log_probs_leads_its_non_finite_step(tmp_path: Path) -> None:
    """Rank 1's engine log-probs are running sums (about 196 nats below the policy's at the end of a response): the
    rollout ratio exp(log π - log π_rollout) overflows there, the step is NaN; the engine mismatch on rank 1 leads."""
    [case] = [c for c in matrix_cases(("held_out_viii",)) if c.name.endswith(":qwen2_moe_rollout_logprobs_cumulative")]
    _assert_driver_leads(diagnosed_case(case, tmp_path), "engine_mismatch", "rollout")


@pytest.mark.slow
def test_old_log_probs_stored_on_another_scale_lead_their_non_finite_step(tmp_path: Path) -> None:
    """Rank 1's old log-probs stored x64 (a worker that accumulated into a buffer it never zeroed, 64 times): each is
    finite, but the PPO ratio against them overflows; the stale old log-probs on rank 1 lead, and the samples whose
    values pass the bound are offered to be left out."""
    fault = FaultSpec("logprob_scale", ranks=(1,), params={"signal": "old_logprobs", "factor": 64.0})
    case = MatrixCase("story:old_logprobs_x64", "stale_old_logprobs", "peaked", "held_out", (fault,), model="tiny_moe")
    d = diagnosed_case(case, tmp_path)
    _assert_driver_leads(d, "stale_old_logprobs", "old")
    [symptom] = [c for c in d.causes if c.family == "non_finite"]
    dropped = [e.mitigation for e in symptom.experiments if e.mitigation.startswith("drop_samples=")]
    assert dropped and all(pair.startswith("1:") for pair in dropped[0].removeprefix("drop_samples=").split(","))
