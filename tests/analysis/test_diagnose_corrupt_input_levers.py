"""Every corrupt input `diagnose` names comes with an experiment that removes the bad part, and that experiment runs
to a verdict: a finding nothing can prove is no finding.

The story: one rank passes per-token weights (1 / response length on each response token) where the loss expects
its 0/1 loss mask. `diagnose` names that rank's mask as the top cause; the suggestion that leaves the rank out is
kept (it was once dropped: the mask check offered no experiment), and its replay has a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from snapshot_edits import copy_fixture, diagnosed, edit_batch

from axrl_spike_replay.investigation.request import How, Verb, What, replay_request
from axrl_spike_replay.replay.sweep import run_sweep
from axrl_spike_replay.testing.fault_matrix import burst_snapshots, capture_case, matrix_cases


def _mask_as_token_weights(batch: dict[str, Any]) -> None:
    mask = batch["loss_mask"].float()
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    batch["loss_mask"] = mask / lengths  # a sequence mean's weights where the loss expects 0/1


def _tokens_past_vocabulary(batch: dict[str, Any]) -> None:
    tokens = batch["tokens"].clone()
    tokens[0, 3] = 10**6
    batch["tokens"] = tokens


def _verdicts(snapshot: Path, items: list[str]) -> dict[str, str]:
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args

    configs = tuple(parse_mitigation_args([item]) for item in items)
    sweep = run_sweep(replay_request(What(snapshot, verb=Verb.SWEEP, configs=configs), how=How(nproc=1)))
    return {item: str(result.verdict) for item, result in zip(items, sweep.results, strict=True)}


def test_a_mask_of_token_weights_on_one_rank_is_the_finding_with_a_lever_that_has_a_verdict(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    edit_batch(snapshot, 0, _mask_as_token_weights)
    d = diagnosed(snapshot, model="never")
    top = d.causes[0]
    assert top.family == "mask_misalignment" and top.ranks == [0], top
    assert any("neither 0 nor 1" in line for line in top.evidence)
    assert "drop_ranks=0" in [e.mitigation for e in top.experiments]
    assert "drop_ranks=0" in d.mitigation_items()  # suggested, not filtered out
    verdicts = _verdicts(snapshot, ["drop_ranks=0"])
    assert verdicts["drop_ranks=0"] in {"cleared", "partial", "no_effect", "worse", "baseline_not_a_spike"}, verdicts


@pytest.mark.parametrize("edit", [_mask_as_token_weights, _tokens_past_vocabulary])
def test_every_corrupt_input_cause_keeps_an_experiment_that_removes_it(tmp_path: Path, edit: Any) -> None:
    """Whether or not the step's own replay is defined on the input (token ids past the vocabulary: it is not)."""
    from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot

    snapshot = copy_fixture(tmp_path)
    edit_batch(snapshot, 1, edit)
    d = diagnose_snapshot(snapshot, model="never")
    inputs = [c for c in d.causes if c.figures.get("input_findings")]
    assert inputs, [c.family for c in d.causes]
    for cause in inputs:
        assert cause.ranks == [1] and cause.experiments, cause
    assert "drop_ranks=1" in d.mitigation_items()


@pytest.mark.slow
@pytest.mark.matrix  # a capture on qwen2_moe or olmoe: the per-architecture matrix, run on request
def test_a_real_run_whose_rank_passes_token_weights_as_its_mask_is_proven_by_leaving_the_rank_out(
    tmp_path: Path,
) -> None:
    """Held-out VII's case, as the reference trainer runs it: the cause is first, and the experiment clears it."""
    [case] = [c for c in matrix_cases(("held_out_vii",)) if c.name.endswith(":qwen2_moe_loss_mask_as_token_weights")]
    run = capture_case(case, tmp_path, model=case.model or "tiny_moe")
    snapshots = burst_snapshots(run, case.preset)
    assert snapshots, f"no spike at the burst: {run.grad_norms}"
    from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot

    d = diagnose_snapshot(snapshots[0], model="auto")
    assert d.top.family == "mask_misalignment" and d.top.ranks == [0], d.top
    assert "drop_ranks=0" in d.mitigation_items()
    assert _verdicts(snapshots[0], ["drop_ranks=0"]) == {"drop_ranks=0": "cleared"}
