"""`axrl-spike-replay capture` and `checkpoint-interval` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.cli import main


@pytest.mark.parametrize("world_size", [1, 2])
def test_capture_json_reports_the_spikes_and_snapshots(tmp_path: Path, capfd, world_size: int) -> None:
    argv = ["capture", "--out", str(tmp_path), "--job", "cli-job", "--world-size", str(world_size), "--steps", "21"]
    status = main([*argv, "--json"])
    out, err = capfd.readouterr()  # fd level: rank 0 runs in a process of its own at world size 2
    assert status == 0
    doc = json.loads(out)  # exactly one JSON document on stdout
    assert doc["world_size"] == world_size and doc["preset"] == "ratio_outliers" and doc["job_name"] == "cli-job"
    assert doc["output_dir"] == str(tmp_path / "ref-s0~cli-job__actor")
    assert doc["spike_iterations"] == [20, 21] and len(doc["grad_norms"]) == 21
    assert [Path(p).name for p in doc["snapshot_dirs"]] == ["iter_0000020", "iter_0000021"]
    assert Path(doc["log_path"]).is_file()
    assert "capture: training 21 steps" in err
    # progress streams from the rank as it trains (every few iterations and at each spike), before the summary
    lines = err.splitlines()
    iterations = [line for line in lines if line.startswith("capture: iteration ")]
    assert iterations[0].startswith("capture: iteration 2/21: grad norm ") and len(iterations) >= 8
    assert "iteration 20/21: grad norm" in iterations[-2] and "spike (" in iterations[-2]
    assert "snapshot checkpoints/spike_snapshots/iter_0000020" in iterations[-2]
    assert lines.index(iterations[-1]) < lines.index(next(x for x in lines if x.startswith("capture: done in ")))


def test_capture_summary_for_people(tmp_path: Path, capsys) -> None:
    assert main(["capture", "--out", str(tmp_path), "--preset", "none", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "no spike detected" in out and "ref-s0~demo-moe-grpo__actor" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "0"], "--world-size must be between 1 and 64, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--preset", "chaos"], "--preset 'chaos' is not known"),
        (["--job", "a/b"], "--job 'a/b' must be letters"),
    ],
)
def test_capture_bad_arguments_exit_2_naming_the_argument(tmp_path: Path, capsys, argv, message) -> None:
    assert main(["capture", "--out", str(tmp_path), *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and captured.out == ""


def test_capture_model_trains_the_named_transformers_architecture(tmp_path: Path, capsys) -> None:
    argv = ["capture", "--out", str(tmp_path), "--model", "qwen3_moe", "--steps", "2", "--preset", "none", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["model"] == "qwen3_moe" and doc["snapshot_dirs"] == []
    assert len(doc["grad_norms"]) == 2 and all(g is not None and g > 0 for g in doc["grad_norms"])
    assert "model qwen3_moe ..." in err
    log = Path(doc["log_path"]).read_text()
    assert "> reference trainer: job demo-moe-grpo, model qwen3_moe, preset none," in log  # what the rank built
    iterations = [line.split()[1] for line in log.splitlines() if line.startswith(" iteration ")]
    assert iterations == ["1/", "2/"]  # two steps trained


def test_capture_refuses_an_existing_output_dir(tmp_path: Path, capsys) -> None:
    (tmp_path / "ref-s0~demo-moe-grpo__actor").mkdir()
    assert main(["capture", "--out", str(tmp_path), "--steps", "2"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_checkpoint_interval_json(capsys) -> None:
    argv = ["checkpoint-interval", "--checkpoint-cost", "20", "--mtbf-steps", "2000", "--step-time", "1", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["optimal_interval_steps"] == 283
    assert {o["interval_steps"] for o in doc["options"]} >= {141, 283, 566}


def test_checkpoint_interval_for_people(capsys) -> None:
    assert main(["checkpoint-interval", "--checkpoint-cost", "20", "--mtbf-steps", "2000", "--step-time", "1"]) == 0
    out = capsys.readouterr().out
    assert "optimal checkpoint interval: 283 steps" in out
    header, _, *rows = out.splitlines()[1:]
    assert header.split() == ["interval", "(steps)", "checkpointing", "rework", "total", "optimal"]
    assert [row.split()[0] for row in rows if row.rstrip().endswith("K*")] == ["283"]


@pytest.mark.parametrize("flag", ["--checkpoint-cost", "--mtbf-steps", "--step-time"])
def test_checkpoint_interval_bad_values_name_the_argument(capsys, flag: str) -> None:
    values = {"--checkpoint-cost": "20", "--mtbf-steps": "2000", "--step-time": "1", flag: "0"}
    argv = ["checkpoint-interval"] + [x for pair in values.items() for x in pair]
    assert main(argv) == 2
    assert f"{flag} must be a finite number > 0, got 0" in capsys.readouterr().err
