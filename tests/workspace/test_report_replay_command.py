"""The report's (and the task's) replay command is the baseline's, however many what-if replays ran after it; each
attempt's row keeps its own command. A what-if replay run before any baseline records the baseline's command beside
its own (`baseline_command.txt`), so the task shows that one, never the what-if's."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
from axrl_spike_replay.investigation.task_opening import open_task

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
JOB = "fixture-moe"


def _spike(tmp_path: Path) -> Path:
    out = tmp_path / "outputs" / FIXTURE.name
    shutil.copytree(FIXTURE, out)
    return out / "checkpoints" / "spike_snapshots" / "iter_0000021"


def _report_command(text: str) -> str:
    """The command in the report's 'Replay command:' block."""
    after = text.split("Replay command:", 1)[1]
    return after.split("```bash\n", 1)[1].split("\n```", 1)[0].strip()


@pytest.mark.slow
def test_the_report_shows_the_baselines_command_and_each_attempt_keeps_its_own(tmp_path: Path, cli) -> None:
    spike = _spike(tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    view = open_task(ws, JOB, spike, diagnosis="off")
    run = cli("replay", spike, "--nproc", "1", "--workspace", ws, "--job", JOB, "--json")
    assert run.code == 0, run.err
    for item in ("dual_clip_c=3", "mismatch_token_clip_max=2", "aux_loss_coef=0.5@1"):
        run = cli("replay", spike, "--nproc", "1", "--mitigation", item, "--workspace", ws, "--job", JOB, "--json")
        assert run.code == 0, run.err
    state = json.loads(Path(view.state_file).read_text())
    rows = state["experiments"]
    baseline = rows[0]
    assert baseline["is_baseline"] and "--mitigation" not in baseline["command"]
    assert state["command"] == baseline["command"]  # not the last what-if's
    for row, item in zip(rows[1:], ("dual_clip_c=3", "mismatch_token_clip_max=2", "aux_loss_coef=0.5@1"), strict=True):
        words = shlex.split(row["command"])  # each keeps its own
        own = words[words.index("--mitigation") + 1]
        assert parse_mitigation_args([own]) == parse_mitigation_args([item])
    run = cli("report", JOB, "--workspace", ws, "--json")
    assert run.code == 0, run.err
    text = run.json()["text"]
    assert _report_command(text) == baseline["command"]
    for row in rows[1:]:
        assert f"- {row['id']}: `{row['command']}`" in text


@pytest.mark.slow
def test_a_what_if_run_first_shows_the_baselines_command(tmp_path: Path, cli) -> None:
    spike = _spike(tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    view = open_task(ws, JOB, spike, diagnosis="off")
    options = ("--nproc", "1", "--workspace", ws, "--job", JOB)
    run = cli("sweep", spike, "--mitigation", "dual_clip_c=3", *options, "--json")
    assert run.code == 0, run.err
    run = cli("replay", spike, "--nproc", "1", "--mitigation", "advantage_clip=1", "--workspace", ws, "--job", JOB)
    assert run.code == 0, run.err
    state = json.loads(Path(view.state_file).read_text())
    baseline, *attempts = state["experiments"]
    expected = shlex.join(
        ["axrl-spike-replay", "replay", str(spike), "--nproc", "1", "--device", "cpu", "--workspace", str(ws)]
    )  # the command recorded as people rerun it: in this workspace
    assert baseline["is_baseline"] and baseline["command"] == expected  # the sweep's baseline row: its own command
    assert state["command"] == expected
    assert "sweep" in attempts[0]["command"] and "advantage_clip=1" in attempts[1]["command"]


@pytest.mark.slow
def test_a_replay_of_another_iteration_leaves_the_active_snapshots_command(tmp_path: Path, cli) -> None:
    """An investigation checks the spike's neighbouring iteration beside the active one: the task's (and the
    report's) replay command still replays the active snapshot."""
    spike = _spike(tmp_path)  # iter_0000021, the task's active snapshot
    other = spike.parent / "iter_0000020"
    ws = tmp_path / "ws"
    ws.mkdir()
    view = open_task(ws, JOB, spike, diagnosis="off")
    for snapshot in (spike, other):
        run = cli("replay", snapshot, "--nproc", "1", "--workspace", ws, "--job", JOB, "--json")
        assert run.code == 0, run.err
    state = json.loads(Path(view.state_file).read_text())
    assert state["experiments"][0]["command"] == state["command"]
    assert str(spike) in state["command"] and str(other) not in state["command"]
    run = cli("report", JOB, "--workspace", ws, "--json")
    assert run.code == 0, run.err
    assert str(spike) in _report_command(run.json()["text"])
