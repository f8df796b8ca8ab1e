"""The non_finite cause family on hand-edited copies of the golden snapshot, and the NaN trap: a non-finite value
is the non_finite family's evidence and never makes another cause strong."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from snapshot_edits import copy_fixture, edit_batch, edit_grad_info, no_mismatch

from axrl_spike_replay.analysis.batch_signals import analyze_snapshot
from axrl_spike_replay.analysis.grad_info import top_param_grads
from axrl_spike_replay.diagnosis.diagnose import RULES, diagnose_snapshot
from axrl_spike_replay.diagnosis.evidence.model_evidence import LayerAgreement, RouteAgreement
from axrl_spike_replay.diagnosis.rules import causes
from axrl_spike_replay.diagnosis.rules.causes import Evidence
from axrl_spike_replay.experiment.result import Attribution, SampleContribution


def _families(diagnosis) -> dict[str, float]:
    return {c.family: c.strength for c in diagnosis.causes}


def test_one_nan_advantage_is_reported_as_non_finite_and_makes_no_cause_strong(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    edit_batch(snapshot, 0, lambda b: b["advantages"].__setitem__(2, math.nan))  # sample 0:2, 8 loss tokens
    balance = analyze_snapshot(snapshot).sign_balance
    assert balance is not None and balance["non_finite_tokens"] == 8
    assert math.isfinite(balance["positive_total"]) and math.isfinite(balance["negative_total"])

    d = diagnose_snapshot(snapshot, model="never")
    strengths = _families(d)
    assert d.causes[0].family == "engine_mismatch"  # the real cause stays first
    assert "negative_advantage_dominance" not in strengths  # was 1.00 from min(1.0, nan)
    non_finite = next(c for c in d.causes if c.family == "non_finite")
    assert non_finite.strength == causes.NON_FINITE_INPUTS < strengths["engine_mismatch"]
    assert non_finite.evidence[0] == "8 non-finite advantages on loss tokens"
    assert "recorded grad norm 56.78 is finite" in non_finite.evidence[1]
    assert "drop_samples=0:2" in d.mitigation_items()
    assert non_finite.ranks == [0]
    assert all(math.isfinite(s) for s in strengths.values())


def test_nan_rollout_logprobs_do_not_pass_for_a_log_prob_mismatch(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, lambda b: b["rollout_logprobs"].__setitem__(5, math.nan))  # one sample's row
    d = diagnose_snapshot(snapshot, model="never")
    strengths = _families(d)
    # analyze counts the NaN log-ratios as outside [0.5, 2] (6 % of loss tokens): judged on the finite ones, none is
    assert "engine_mismatch" not in strengths and "stale_old_logprobs" not in strengths
    assert d.causes[0].family == "non_finite" and d.causes[0].strength == causes.NON_FINITE_INPUTS
    assert d.causes[0].evidence[0].endswith("non-finite rollout logprobs on loss tokens")
    assert "drop_samples=1:5" in d.mitigation_items()
    assert d.causes[0].ranks == [1]  # the rank that holds them


def test_a_non_finite_recorded_norm_is_the_strongest_cause(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    edit_grad_info(snapshot, 1, lambda info: info["param_grad_norms"].update(dict.fromkeys(["head.weight"], math.inf)))
    d = diagnose_snapshot(snapshot, model="never")
    top = d.causes[0]
    assert top.family == "non_finite" and top.strength == 1.0
    assert "rank 1's recorded per-parameter grad norms are not finite" in top.evidence
    assert top.figures["recorded_norm_finite"] is False
    assert top.ranks == [1]
    # every stored log-prob finite and none found past exp()'s bound: the clamp before exp() would change nothing
    assert "log_ratio_clip=5" not in d.mitigation_items()


def _with_nan_evidence(snapshot: Path) -> Evidence:
    """The real evidence of an outlier-advantage spike with NaN in every figure a family reads beyond the batch."""
    analysis = analyze_snapshot(snapshot)
    nan_sample = SampleContribution(
        rank=1, sample=3, contribution=math.nan, share=math.nan, advantage=200.0, reward=None,
        max_abs_log_ratio_current_vs_base=math.nan, loss_tokens=8,
    )  # fmt: skip
    samples = [nan_sample, dataclasses.replace(nan_sample, rank=0, sample=1)]
    attribution = Attribution(
        snapshot=str(snapshot), grad_norm=math.nan, recorded_grad_norm=analysis.grad_norm, rel_diff=None,
        fidelity="full", world_size_saved=2, total_samples=16, samples=samples, router_term=0.0,
        contribution_sum=math.nan, sum_rel_error=math.nan,
    )  # fmt: skip
    routes = RouteAgreement([LayerAgreement(0, 64, 0, math.nan, None), LayerAgreement(1, 64, 0, 0.01, None)], "all")
    return Evidence(analysis=analysis, grads=top_param_grads(snapshot), attribution=attribution, routes=routes,
                    world_size=2)  # fmt: skip


def test_no_family_turns_a_nan_figure_into_a_strong_cause(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 1, lambda b: b["advantages"].__setitem__(3, b["advantages"][3] * 200.0))
    ev = _with_nan_evidence(snapshot)
    found = {f.__name__: f(ev) for f in RULES}
    assert found["routing_payload"] is None  # a NaN disagreement is no disagreement (was min(1.0, nan) = 1.0)
    assert found["one_rank_data"] is None  # NaN shares carry nothing
    outlier = found["outlier_advantage"]
    # NaN share: nothing carried (was 1.0); the sample's advantage, 200 times what GRPO makes of its reward, leaves
    # its group off centre: rank 1's advantages are not its rewards' (BASE 0.6, its share of the gradient unknown)
    assert outlier is not None and outlier.strength == pytest.approx(0.6)
    assert outlier.figures["samples"] == [[1, 3]] and outlier.ranks == [1]
    assert outlier.figures["against_own_rewards"]["groups_failing"] == {1: 1}
    for cause in found.values():
        assert cause is None or 0.0 <= cause.strength <= 1.0


def test_a_nan_reward_that_made_the_step_non_finite_gets_no_log_ratio_clip(tmp_path: Path) -> None:
    """A NaN reward makes its group's advantages NaN and the step's norm NaN; no clip of the log-ratio reaches an
    advantage, so `log_ratio_clip` would be a no-op (the matrix's verifier_nan replays measured no effect)."""
    import json

    snapshot = copy_fixture(tmp_path)

    def nan_advantage(b: dict[str, Any]) -> None:
        b["advantages"] = b["advantages"].clone()
        b["advantages"][5] = float("nan")

    edit_batch(snapshot, 1, nan_advantage)
    meta_path = snapshot / "axrl_metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["grad_norm"] = float("nan")
    meta_path.write_text(json.dumps(meta))
    d = diagnose_snapshot(snapshot, model="never")
    cause = next(c for c in d.causes if c.family == "non_finite")
    assert cause.strength == 1.0
    assert "log_ratio_clip=5" not in [e.mitigation for e in cause.experiments]
    assert any(e.mitigation.startswith("drop_samples=") for e in cause.experiments)


def _nan_reward_of_sample_5(b: dict[str, Any]) -> None:
    """The verifier returned NaN for rank 1's sample 5: GRPO's group mean and std make its whole group NaN."""
    b["rewards"] = b["rewards"].clone()
    b["rewards"][5] = float("nan")
    b["advantages"] = b["advantages"].clone()
    b["advantages"][b["group_index"] == b["group_index"][5]] = float("nan")


def test_a_nan_reward_is_named_and_its_group_is_dropped_by_an_experiment_with_a_verdict(tmp_path: Path) -> None:
    """A NaN reward made a step's norm NaN: the reward is named, and the suggestion leaves out its whole group (half
    a rank's batch: no 'few samples' limit keeps a NaN in), which the replay judges."""
    import json

    from axrl_spike_replay.investigation.request import How, Verb, What, replay_request
    from axrl_spike_replay.replay.sweep import run_sweep

    snapshot = copy_fixture(tmp_path)
    edit_batch(snapshot, 1, _nan_reward_of_sample_5)
    meta_path = snapshot / "axrl_metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["grad_norm"] = float("nan")
    meta_path.write_text(json.dumps(meta))
    d = diagnose_snapshot(snapshot, model="never")
    top = d.causes[0]
    assert top.family == "non_finite" and top.ranks == [1]
    assert any(line.startswith("rewards that are not finite on sample 1:5") for line in top.evidence), top.evidence
    assert d.mitigation_items()[0] == "drop_samples=1:4,1:5,1:6,1:7"
    what = What(snapshot, verb=Verb.SWEEP, configs=({"drop_samples": "1:4,1:5,1:6,1:7"},))
    [result] = run_sweep(replay_request(what, how=How(nproc=1))).results
    assert result.grad_norm is not None and math.isfinite(result.grad_norm)  # the step is finite without the group
    assert str(result.verdict) in {"cleared", "partial"}  # the fixture's own log-prob mismatch spike may remain


@pytest.mark.slow
def test_the_verifier_nan_run_is_proven_by_dropping_the_nan_rewards_group(tmp_path: Path) -> None:
    """The preset's genuine run: the verifier returns NaN for one sample of the last rank; the experiment diagnose
    suggests clears the step."""
    from axrl_spike_replay.investigation.request import Verb, What, replay_request
    from axrl_spike_replay.replay.sweep import run_sweep
    from axrl_spike_replay.testing.fault_matrix import burst_snapshots, capture_case, matrix_cases

    [case] = [c for c in matrix_cases(("preset",)) if c.name == "verifier_nan"]
    run = capture_case(case, tmp_path)
    [snapshot, *_] = burst_snapshots(run, case.preset)
    d = diagnose_snapshot(snapshot, model="auto")
    assert d.top.family == "non_finite" and d.top.ranks == [1]
    [item] = [i for i in d.mitigation_items() if i.startswith("drop_samples=")]
    assert "1:5" in item.split("=")[1].split(",")
    name, _, value = item.partition("=")
    [result] = run_sweep(replay_request(What(snapshot, verb=Verb.SWEEP, configs=({name: value},)))).results
    assert str(result.verdict) == "cleared"
