"""The report shows the consistency each baseline replay recorded, beside the task-open diagnosis's: a recorded
per-rank loss edited after the fact passes the static checks, and only the replay catches it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.report import write_report

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
JOB = "fixture-moe"


@pytest.mark.slow
def test_the_report_shows_the_baseline_replays_consistency_and_its_named_problems(tmp_path: Path) -> None:
    output = tmp_path / "outputs" / FIXTURE.name
    shutil.copytree(FIXTURE, output)
    snapshot = output / "checkpoints" / "spike_snapshots" / "iter_0000021"
    path = snapshot / "grad_info_rank1.pt"
    info = torch.load(path, weights_only=True)
    info["loss"] = info["loss"] * 3.0  # the recorded per-rank loss no longer matches its weights and batch
    torch.save(info, path)

    workspace = tmp_path / "ws"
    workspace.mkdir()
    open_task(workspace, JOB, snapshot)  # static evidence: no replay, so the edit goes unseen here
    baseline = run_request(replay_request(What(snapshot), workspace=workspace, job=JOB))
    assert baseline.verdict == "reproduced"  # the grad norm still matches: the replay "reproduces"

    report = write_report(workspace, JOB)
    diagnosis = report.text.split("## Diagnosis", 1)[1].split("\n## ", 1)[0]
    assert "self-consistent: **yes**" in diagnosis  # what the task-open diagnosis could see
    static = ("spike_ratio_vs_norms, ranks_vs_files, metadata_vs_run_config, rank_grad_norm_vs_metadata, "
              "grad_norm_vs_param_norms, grad_norm_vs_log")  # fmt: skip
    # each names the checks it made and why the others were not: the counts differ for a reason one can read
    not_made = "not made: rank_loss_vs_replay, param_grad_norms_vs_replay: made by `replay`"
    assert f"(6 checks: {static}; {not_made}" in diagnosis
    section = report.text.split("## Baseline replay", 1)[1].split("\n## ", 1)[0]
    assert "- E1: self-consistent: **no**; agrees with the training log: **yes**" in section
    assert (
        f"(snapshot 1 self-inconsistencies; agrees with the training log (8 checks: {static}, rank_loss_vs_replay, "
        "param_grad_norms_vs_replay; not made: grad_norm_vs_replay: made by `diagnose` with model evidence (a replay "
        "judges the global norm in its verdict)))"
    ) in section
    assert "  - [rank_loss_vs_replay] rank 1 recorded loss " in section
    (row,) = report.baselines
    assert row["consistency"]["self_consistent"] is False
    assert [p["name"] for p in row["consistency"]["problems"]] == ["rank_loss_vs_replay"]
