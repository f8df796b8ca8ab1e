"""A step whose cause is a loss coefficient raised on one rank (the reference trainer's `loss_setting` fault: rank 1
computes its loss with aux_loss_coef 40.96 where the run, and its snapshot, say 0.01) does not reproduce; `diagnose`
names the hypothesis replays that would explain rank 1's recorded loss, and the replay under the right one reproduces
the recorded global grad norm within 1e-6 and each rank's recorded loss within 1e-6. The result, the task row and the
report say "reproduced under `aux_loss_coef=40.96@1`" and never call it a mitigation."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from axrl_spike_replay.capture.fault_injection.faults import make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot, render_diagnosis
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.snapshot.rank_data import recorded_rank_loss

HYPOTHESIS = "aux_loss_coef=40.96@1"
BURST = 12


@pytest.fixture(scope="module")
def raised_coefficient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The spike snapshot of a healthy run whose rank 1 computes its loss with aux_loss_coef 40.96 at the burst."""
    logging.getLogger("axrl_spike_replay.guard").setLevel(logging.ERROR)
    out = tmp_path_factory.mktemp("raised-coefficient")
    fault = make_fault(FaultSpec("loss_setting", ranks=(1,), params={"aux_loss_coef": 40.96}))
    run = capture_reference_run(
        out,
        job="raised-coef",
        world_size=2,
        steps=BURST,
        preset="none",
        faults=[fault],
        overrides={"train": {"burst": [BURST]}},
    )
    assert BURST in run.spike_iterations, run.grad_norms
    yield run.snapshot_dirs[run.spike_iterations.index(BURST)]


@pytest.mark.slow
def test_the_hypothesis_replay_reproduces_the_norm_and_every_ranks_loss(
    raised_coefficient: Path, warm_runner: JobRunner
) -> None:
    snapshot = raised_coefficient
    baseline = run_replay(replay_request(What(snapshot), how=How(nproc=1)))
    assert baseline.verdict == "not_reproduced"
    result = run_replay(replay_request(What(snapshot, mitigations={"aux_loss_coef": "40.96@1"})), runner=warm_runner)
    assert result.verdict == "reproduced" and result.finding == f"reproduced under `{HYPOTHESIS}`"
    assert result.mitigations == {} and result.hypothesis == {"aux_loss_coef": {"ranks": [1], "value": 40.96}}
    assert result.fidelity == "full" and result.rel_diff is not None and result.rel_diff <= 1e-6  # the recorded norm
    for row in result.rank_metrics:  # ... and each rank's recorded loss
        recorded = recorded_rank_loss(snapshot, row["rank"])
        assert recorded is not None and abs(row["loss"] - recorded) <= 1e-6 * max(1.0, abs(recorded)), row
    assert all(row["matches"] for row in result.verdict_basis.rank_losses)
    wrong = run_replay(replay_request(What(snapshot, mitigations={"aux_loss_coef": "40.96@0"}), how=How(nproc=1)))
    assert wrong.verdict == "not_reproduced" and wrong.finding == "not reproduced under `aux_loss_coef=40.96@0`"


@pytest.mark.slow
def test_diagnose_suggests_the_hypothesis_that_proves_it(raised_coefficient: Path) -> None:
    diagnosis = diagnose_snapshot(raised_coefficient, model="always")
    items = [e.mitigation for e in diagnosis.hypotheses]
    assert items[0] == HYPOTHESIS, items  # the shortest value first: a coefficient someone set
    assert {item.split("=")[0] for item in items} >= {"aux_loss_coef", "z_loss_coef", "loss_scale"}
    assert all(item.endswith("@1") for item in items)  # rank 0 computed what the run says
    assert diagnosis.consistency is not None
    assert "rank_loss_vs_replay" in {p.name for p in diagnosis.consistency.problems}
    assert f"--mitigation {HYPOTHESIS}" in render_diagnosis(diagnosis)
    # every suggestion gives rank 1's recorded loss; only the replay tells which also gives the grad norm
    name, value = items[1].split("=")
    result = run_replay(replay_request(What(raised_coefficient, mitigations={name: value}), how=How(nproc=1)))
    rank1 = next(r for r in result.verdict_basis.rank_losses if r["rank"] == 1)
    assert math.isclose(rank1["replayed_loss"], rank1["recorded_loss"], rel_tol=1e-5)
    assert result.verdict == "not_reproduced"


@pytest.mark.slow
def test_the_task_row_and_the_report_say_reproduced_under_the_hypothesis(
    raised_coefficient: Path, tmp_path: Path, cli
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    view = open_task(ws, "raised-coef", raised_coefficient, diagnosis="off")
    run = cli("replay", raised_coefficient, "--nproc", "1", "--workspace", ws, "--job", "raised-coef")
    assert run.code == 0, run.err
    options = ("--nproc", "1", "--workspace", ws, "--job", "raised-coef")
    run = cli("replay", raised_coefficient, "--mitigation", HYPOTHESIS, *options)
    assert run.code == 0, run.err
    assert f"verdict       reproduced under `{HYPOTHESIS}`" in run.out
    assert "mitigation" not in run.out.split("verdict", 1)[0].split("spike ratio", 1)[1]  # never called one
    row = json.loads(Path(view.state_file).read_text())["experiments"][-1]
    assert row["finding"] == f"reproduced under `{HYPOTHESIS}`" and row["change"] == f"hypothesis {HYPOTHESIS}"
    assert row["mitigations"] == {} and not row["is_baseline"] and row["rank_losses_match"] is True
    task_md = Path(view.task_file).read_text()
    assert f"reproduced under `{HYPOTHESIS}`" in task_md.replace("\\`", "`")
    report = cli("report", "raised-coef", "--workspace", ws, "--json").json()
    text = report["text"]
    hypotheses = text.split("## Hypotheses", 1)[1].split("## Mitigation attempts", 1)[0]
    assert f"reproduced under `{HYPOTHESIS}`" in hypotheses.replace("\\`", "`") and "all match" in hypotheses
    attempts = text.split("## Mitigation attempts", 1)[1].split("## Methods added", 1)[0]
    assert "_No mitigation was tried._" in attempts
    assert [h["id"] for h in report["hypotheses"]] == [row["id"]] and report["attempts"] == []
