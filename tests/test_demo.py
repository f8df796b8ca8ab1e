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
    assert method[3:] == ["--mitigation", "mismatch_token_clip_max=2.0", "--workspace", demo_run["workspace"]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # as copied, from this test's directory: it records in the demo's workspace
        assert main([*method[1:], "--json"]) == 0
    doc = json.loads(out.getvalue())
    assert doc["verdict"] == "cleared" and doc["output_dir"].startswith(demo_run["workspace"] + "/tmp/spike-replay/")


def test_demo_says_what_it_planted_and_reports_the_diagnosis_the_model_evidence_makes(demo_run: dict) -> None:
    """The static diagnosis cannot tell stale old log-probs from a rollout engine mismatch; the demo replays the step
    anyway, so the report carries the diagnosis with the model evidence, and what the demo planted to check it by."""
    assert demo_run["planted"] == demo_run["diagnosed"] == "engine_mismatch"
    run_config = (Path(demo_run["snapshot"]) / "run_config.yaml").read_text()
    assert "ratio_outliers" not in run_config and "preset: hidden" in run_config  # the answer is not on disk
    report = Path(demo_run["report"]).read_text()
    diagnosis = report.split("## Diagnosis", 1)[1].split("\n## ", 1)[0]
    assert "model evidence `auto`" in diagnosis and "old agrees with the replay on rank 0" in diagnosis
    assert "1. **rollout/trainer log-prob mismatch** (`engine_mismatch`, strength 1.00)" in diagnosis
    assert "recompute=old_logprobs" not in report.split("## Next steps", 1)[-1].split("\n## ", 1)[0]
    assert "no longer suggests `recompute=old_logprobs`" in report
    observations = report.split("## Observations", 1)[1].split("\n## ", 1)[0]
    assert "- **Planted by the demo:** preset `ratio_outliers`, cause family `engine_mismatch`: " in observations
    assert "the diagnosis names it first" in observations


def test_the_demos_record_reads_cleanly(demo_run: dict) -> None:
    """What a first hour with the demo turned up: noise, wording, commands that only run from one directory, files
    naming the released copy."""
    workspace = demo_run["workspace"]
    report = Path(demo_run["report"]).read_text()
    task = Path(demo_run["task_file"]).read_text()
    for text in (report, task):
        assert "missing field: turn_index" not in text  # the reference trainer's batches are single-turn
    assert "5 methods written up" in report and "read them.\nBest-ranked first" in report  # no "them.Best"
    assert "**On Megatron-LM:**" in report and "no flag for\nthese methods" in report
    assert f"--workspace {workspace}" in _code_after(task, "## Replay command")
    for path in demo_run["methods"]:
        text = Path(path).read_text()
        fields = text.split("---\n", 2)[1]
        assert f"\nsnapshot: {demo_run['snapshot']}\n" in fields, path  # not the released copy
        assert f"\nreleased_copy: {demo_run['preserved']}\n" in fields, path
        assert f"| snapshot | {demo_run['snapshot']} |" in text and "which was released 20" in text
        assert _code_after(text, "## Replay it").endswith(f"--workspace {workspace}")
        rationale = text.split("## Rationale\n\n", 1)[1]
        assert rationale[0].isupper(), path


def test_demo_trains_the_model_it_is_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "qwen3_moe", "--preset", "none", "--steps", "2", "--world-size", "1"]
    assert main(["demo", "--workspace", str(tmp_path), *argv]) == 2  # no spike to investigate: a clear refusal
    err = capsys.readouterr().err
    assert "the reference run of qwen3_moe (preset 'none', 2 steps) tripped no spike guard" in err
    [log] = tmp_path.glob("*/outputs/*~demo-moe-grpo__actor/logs/train.log")
    assert ", model qwen3_moe, preset hidden, world size 1," in log.read_text()  # what the capture's rank built


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
    from axrl_spike_replay.experiment.mitigation.mitigation_sets import DEFAULT_SWEEP

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
