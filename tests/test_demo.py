"""The demo, as a new user runs it: one command, the whole procedure, files a person can read."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from axrl_spike_replay.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_process(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """`axrl-spike-replay demo --json` in a fresh folder, as its own process (stderr holds every process's lines)."""
    workspace = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": str(REPO / "mcp_server")}
    argv = [sys.executable, "-m", "axrl_spike_replay", "demo", "--workspace", str(workspace), "--json"]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def demo_run(demo_process: subprocess.CompletedProcess[str]) -> dict:
    """The demo's one JSON document."""
    return json.loads(demo_process.stdout)


def test_demo_streams_progress_while_it_works(demo_process: subprocess.CompletedProcess[str]) -> None:
    """Each step says it is starting, and the capture and the replays stream their own lines, before the step's
    summary: no long silence followed by whole sections."""
    lines = demo_process.stderr.splitlines()

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    assert first("demo: capture: a reference GRPO run") < first("capture: iteration 4/32: grad norm ")
    assert first("capture: iteration 4/32") < first("capture: iteration 32/32") < first("== capture")
    assert first("demo: sweep 10 mitigation configs") < first("process 0: mismatch_token_clip_max=2 computed")
    assert first("mismatch_token_clip_max=2: grad norm ") < first("== sweep")


def test_demo_reproduces_the_captured_spike_at_full_fidelity(demo_run: dict) -> None:
    assert demo_run["fidelity"] == "full"
    assert demo_run["baseline_verdict"] == "reproduced"
    assert demo_run["rel_diff"] <= 1e-6
    assert demo_run["baseline_grad_norm"] == pytest.approx(demo_run["recorded_grad_norm"], rel=1e-6)


def test_demo_finds_the_mitigations_that_clear_a_rollout_mismatch_spike(demo_run: dict) -> None:
    assert "mismatch_token_clip_max=2" in demo_run["cleared"]
    assert "is_base_logprobs=old" in demo_run["cleared"]
    assert "routing_replay=off" not in demo_run["cleared"]  # the burst is not a routing fault


def test_demo_leaves_a_task_file_method_files_and_a_report(demo_run: dict) -> None:
    task = Path(demo_run["task_file"]).read_text()
    for section in ("Active snapshot", "Experiment table", "Observations"):
        assert section in task
    assert "mismatch_token_clip_max=2" in task
    names = {Path(p).name for p in demo_run["methods"]}
    assert "token-mismatch-tis-clip-2.md" in names
    assert all("routing-replay-off" not in n for n in names)
    method = (Path(demo_run["workspace"]) / "spike-mitigation-methods" / "token-mismatch-tis-clip-2.md").read_text()
    assert "status: proven" in method and "verdict: cleared" in method
    signals = method.split("## Key signals", 1)[1].split("\n## ", 1)[0]  # quoted from the demo's attribution.json
    assert "- samples carrying the grad norm (of 16): rank " in signals and "attribution.json)" in signals
    assert "- diagnosis: rollout/trainer log-prob mismatch" in signals and "not measured" not in signals
    report = Path(demo_run["report"]).read_text()
    baseline = _table_rows(report, "## Baseline replay")
    assert baseline and all(r["verdict"] == "reproduced" and r["fidelity"] == "full" for r in baseline)
    attempts = _table_rows(report, "## Mitigation attempts")
    tis = [r for r in attempts if r["mitigations / patch"] == "mismatch_token_clip_max=2"]
    assert [r["verdict"] for r in tis] == ["cleared"]
    assert "token-mismatch-tis-clip-2" in report.split("## Methods added", 1)[1]


def test_demo_report_names_the_cause_and_the_method_that_cleared_it(demo_run: dict) -> None:
    assert demo_run["causes"][0] == "rollout/trainer log-prob mismatch"
    task = Path(demo_run["task_file"]).read_text()
    assert "cause 1 of 2: rollout/trainer log-prob mismatch" in task.split("## Observations", 1)[1]
    report = Path(demo_run["report"]).read_text()
    diagnosis = report.split("## Diagnosis", 1)[1].split("\n## ", 1)[0]
    assert "1. **rollout/trainer log-prob mismatch** (`engine_mismatch`" in diagnosis
    assert "self-consistent: **yes**; agrees with the training log: **yes**" in diagnosis
    suggested = _table_rows(report, "## Diagnosis")
    assert suggested[0]["mitigation"] == "mismatch_token_clip_max=2"  # the first experiment it suggests ...
    assert suggested[0]["tried"].endswith(" cleared") and "mismatch_token_clip_max=2" in demo_run["cleared"]  # cleared


def test_demo_releases_its_preserved_copy_and_keeps_the_original(demo_run: dict) -> None:
    assert not Path(demo_run["preserved"]).exists()
    assert (Path(demo_run["snapshot"]) / "axrl_metadata.json").is_file()


def _code_after(text: str, heading: str) -> str:
    """The first bash block after `heading`."""
    return text.split(heading, 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]


def test_the_commands_the_demo_leaves_still_run_after_it_released_its_copy(demo_run: dict) -> None:
    """The report's replay command and each method file's are the first things a newcomer copies."""
    report = Path(demo_run["report"]).read_text()
    command = shlex.split(_code_after(report, "Replay command"))
    assert command[:2] == ["axrl-spike-replay", "replay"] and command[2] == demo_run["snapshot"]
    assert Path(command[2]).is_dir() and demo_run["preserved"] not in _code_after(report, "Replay command")
    for path in demo_run["methods"]:
        method = shlex.split(_code_after(Path(path).read_text(), "## Replay it"))
        assert method[2] == demo_run["snapshot"] and Path(method[2]).is_dir(), path
    tis = Path(demo_run["workspace"]) / "spike-mitigation-methods" / "token-mismatch-tis-clip-2.md"
    method = shlex.split(_code_after(tis.read_text(), "## Replay it"))
    assert method[3:] == ["--mitigation", "mismatch_token_clip_max=2.0"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*method[1:], "--workspace", demo_run["workspace"], "--json"]) == 0
    assert json.loads(out.getvalue())["verdict"] == "cleared"


def test_demo_trains_the_model_it_is_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "qwen3_moe", "--preset", "none", "--steps", "2", "--world-size", "1"]
    assert main(["demo", "--workspace", str(tmp_path), *argv]) == 2  # no spike to investigate: a clear refusal
    err = capsys.readouterr().err
    assert "the reference run of qwen3_moe (preset 'none', 2 steps) tripped no spike guard" in err
    [log] = tmp_path.glob("*/outputs/*~demo-moe-grpo__actor/logs/train.log")
    assert ", model qwen3_moe, preset none, world size 1," in log.read_text()  # what the capture's rank built


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--model", "jamba"], "invalid choice: 'jamba'"), (["--steps", "0"], "--steps must be >= 1, got 0")],
)
def test_demo_bad_arguments_exit_2_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    try:
        code = main(["demo", "--workspace", str(tmp_path), *argv])
    except SystemExit as exc:  # argparse refuses a value outside the choices itself
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.slow
@pytest.mark.matrix
def test_demo_on_deepseek_v3_sweeps_every_default_config(tmp_path: Path) -> None:
    """The architecture whose dense layer 0 used to refuse the whole default sweep."""
    from axrl_spike_replay.experiment.mitigation_sets import DEFAULT_SWEEP

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["demo", "--workspace", str(tmp_path), "--model", "deepseek_v3", "--json"])
    assert code == 0
    doc = json.loads(out.getvalue())
    assert doc["model"] == "deepseek_v3" and doc["fidelity"] == "full"
    assert doc["baseline_verdict"] == "reproduced" and doc["baseline_grad_norm"] == doc["recorded_grad_norm"]
    [sweep_file] = Path(doc["workspace"]).glob("tmp/spike-replay/demo-moe-grpo/*/sweep_result.json")
    results = json.loads(sweep_file.read_text())["results"]
    assert len(results) == len(DEFAULT_SWEEP) and all(r["verdict"] != "failed" for r in results)
    [first] = [r for r in results if r["mitigations"] == {"current_routing_layers": "first"}]
    assert first["resolved_mitigations"] == {"current_routing_layers": [1]}
    assert doc["cleared"]  # the ratio_outliers burst is cleared by the loss-level guards


def _table_rows(markdown: str, heading: str) -> list[dict[str, str]]:
    """The rows of the first table under `heading`, as {column: cell}."""
    lines = markdown.split(heading, 1)[1].split("\n## ", 1)[0].splitlines()
    table = [line.strip().strip("|").split("|") for line in lines if line.startswith("|")]
    header = [cell.strip() for cell in table[0]]
    return [dict(zip(header, (cell.strip() for cell in row), strict=True)) for row in table[2:]]
