"""Opening the task with a snapshot diagnoses it: the likely cause with its numbers goes under Observations, the
experiments to run under Next steps, and the report's Diagnosis section carries the causes, the consistency
verdict and the experiments with the attempts that ran them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
from axrl_spike_replay.investigation.task_opening import open_task

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
JOB = "fixture-moe"


@pytest.fixture
def spike(tmp_path: Path) -> Path:
    """A private copy of the golden ratio_outliers capture's job output dir; its spike snapshot (iteration 21)."""
    out = tmp_path / "outputs" / FIXTURE.name
    shutil.copytree(FIXTURE, out)
    return out / "checkpoints" / "spike_snapshots" / "iter_0000021"


def test_task_open_writes_the_cause_and_the_experiments_into_the_task_file(spike: Path, tmp_path: Path, cli) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    run = cli("task", "open", JOB, "--snapshot", spike, "--workspace", ws, "--json")
    assert run.code == 0, run.err
    opened = run.json()
    assert isinstance(opened, dict)
    cause = opened["observations"][0]["text"]
    assert cause.startswith("diagnose (iteration 21): cause 1 of 2: rollout/trainer log-prob mismatch")
    assert "of loss tokens have π_old/π_rollout outside [0.5, 2]" in cause
    steps = [n["text"] for n in opened["next_steps"]]
    assert steps[0].startswith("replay `--mitigation mismatch_token_clip_max=2`: truncated importance sampling")
    task = Path(opened["task_file"]).read_text()
    observations = task.split("## Observations", 1)[1].split("## ", 1)[0]
    assert "rollout/trainer log-prob mismatch" in observations and "agrees with the training log" in observations
    assert "`--mitigation mismatch_token_clip_max=2`" in task.split("## Next steps", 1)[1]

    again = cli("task", "open", JOB, "--snapshot", spike, "--workspace", ws, "--json").json()
    assert isinstance(again, dict) and len(again["observations"]) == len(opened["observations"])  # once per snapshot

    report = cli("report", JOB, "--workspace", ws, "--json").json()
    assert isinstance(report, dict)
    text = Path(report["path"]).read_text()
    section = text.split("## Diagnosis", 1)[1].split("\n## ", 1)[0]
    assert "1. **rollout/trainer log-prob mismatch** (`engine_mismatch`, strength" in section
    assert "max |log(π_old/π_rollout)| on loss tokens 6.93" in section
    assert "self-consistent: **yes**; agrees with the training log: **yes**" in section
    assert "| 1 | mismatch_token_clip_max=2 |" in section
    assert "| not tried |" in section
    assert report["diagnosis"]["likely"][0]["family"] == "engine_mismatch"


def test_every_suggested_experiment_is_a_ready_mitigation_item(spike: Path, tmp_path: Path) -> None:
    view = open_task(tmp_path, JOB, spike)
    state = json.loads(Path(view.state_file).read_text())
    items = [s["mitigation"] for s in state["diagnoses"][0]["next_steps"]]
    assert items[0] == "mismatch_token_clip_max=2"
    for item in items:
        assert parse_mitigation_args([item])  # what `replay --mitigation ITEM` does with it


def test_diagnosis_off_opens_the_task_without_one_and_an_unreadable_snapshot_says_why(tmp_path: Path) -> None:
    assert open_task(tmp_path, JOB, tmp_path / "nowhere", diagnosis="off").observations == []
    broken = tmp_path / "broken" / "iter_0000003"
    broken.mkdir(parents=True)
    view = open_task(tmp_path, "other", broken)
    assert view.observations[0]["text"].startswith(f"diagnose could not read {broken.resolve()}")
    assert view.snapshot == str(broken.resolve())


@pytest.mark.slow
def test_the_report_shows_which_suggested_experiment_was_run_and_its_verdict(spike: Path, tmp_path: Path, cli) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    first = open_task(ws, JOB, spike).next_steps[0]["text"].split("`")[1].removeprefix("--mitigation ")
    run = cli("replay", spike, "--mitigation", first, "--workspace", ws, "--job", JOB, "--json")
    assert run.code == 0, run.err
    text = Path(cli("report", JOB, "--workspace", ws, "--json").json()["path"]).read_text()
    section = text.split("## Diagnosis", 1)[1].split("\n## ", 1)[0]
    assert "| E1 cleared |" in section


@pytest.mark.slow
def test_a_later_diagnosis_with_the_model_is_the_one_the_report_shows(spike: Path, tmp_path: Path, cli) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    opened = open_task(ws, JOB, spike)  # `never`: route agreement and attribution not checked
    run = cli("diagnose", spike, "--workspace", ws, "--model", "auto", "--json")
    assert run.code == 0, run.err
    state = json.loads(Path(opened.state_file).read_text())
    assert [d["model"] for d in state["diagnoses"]] == ["never", "auto"]
    assert len(state["diagnoses"][1]["not_checked"]) < len(state["diagnoses"][0]["not_checked"])
    report = cli("report", JOB, "--workspace", ws, "--json").json()
    assert isinstance(report, dict) and report["diagnosis"]["model"] == "auto"
    again = open_task(ws, JOB, spike)  # re-opening adds nothing, and the stronger diagnosis stays the report's
    assert len(again.observations) == len(state["observations"])
    steps = [row["mitigation"] for row in again.next_steps if "mitigation" in row]
    assert len(steps) == len(set(steps))  # each experiment listed once, whichever diagnosis suggested it


@pytest.mark.slow
def test_next_steps_leave_out_the_experiments_already_run(spike: Path, tmp_path: Path, cli) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    steps = open_task(ws, JOB, spike).next_steps
    first = steps[0]["mitigation"]
    run = cli("replay", spike, "--mitigation", first, "--workspace", ws, "--job", JOB, "--json")
    assert run.code == 0, run.err
    shown = cli("task", "show", JOB, "--workspace", ws, "--json").json()
    assert isinstance(shown, dict)
    assert [row["text"] for row in shown["next_steps"]] == [row["text"] for row in steps[1:]]
    task = Path(shown["task_file"]).read_text().split("## Next steps", 1)[1]
    assert f"--mitigation {first}`" not in task and f"--mitigation {steps[1]['mitigation']}`" in task
    report = Path(cli("report", JOB, "--workspace", ws, "--json").json()["path"]).read_text()
    assert f"--mitigation {first}`" not in report.split("\n## Next steps", 1)[1].split("\n## ", 1)[0]
    state = json.loads(Path(shown["state_file"]).read_text())
    assert len(state["next_steps"]) == len(steps)  # the record keeps them all; the views leave the run ones out
