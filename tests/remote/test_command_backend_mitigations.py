"""Mitigations on the command backend: our names mapped onto the trainer's own overrides, sweeps, patch sets.

The trainer's replay command here is a real script in a git checkout: it honours its overrides (the grad
norm it reports depends on them), logs every run's arguments, and reads a factor a patch can change.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import yaml
from remote_helpers import PATCH, RECORDED, git

from axrl_spike_replay.cli import main
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import config_id, parse_config
from axrl_spike_replay.experiment.result import ReplayResult, SweepResult
from axrl_spike_replay.investigation.elsewhere import replay_elsewhere
from axrl_spike_replay.investigation.request import ReplayRequest, What, Where, replay_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.remote.workspace_config import parse_workspace_config
from axrl_spike_replay.vocabulary import Backend, Verdict
from axrl_spike_replay.workspace.method_files.sweep_writeup import write_up_sweep
from axrl_spike_replay.workspace.task_record.task_state import read_state

USER_REPLAY = """\
import argparse, json, pathlib, sys
p = argparse.ArgumentParser()
p.add_argument("--snapshot"); p.add_argument("--out")
p.add_argument("--actor.mismatch_token_clip_max", dest="clip", type=float)
p.add_argument("--moe.routing_replay", dest="routing")
p.add_argument("--init", dest="init")
a = p.parse_args()
with open(RUNS, "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
meta = json.loads(pathlib.Path(a.snapshot, "axrl_metadata.json").read_text())
norm = meta["grad_norm"] * float(pathlib.Path("factor.txt").read_text())
if a.clip is not None:
    norm *= min(1.0, a.clip / 10)  # clipping the mismatch ratio at C scales this toy step by C / 10
if a.routing == "off":
    norm *= 1.2
print(f"grad_norm={norm!r}", flush=True)
pathlib.Path(a.out, "replay_result.json").write_text(json.dumps({"grad_norm": norm, "device": "cpu"}))
"""
# applied in order: A halves the factor, B (written against A's result) takes it to 0.01
PATCH_A = PATCH.replace("+0.001", "+0.5")
PATCH_B = PATCH.replace("-1.0", "-0.5").replace("+0.001", "+0.01")
MAPPING = """\
  mitigations:
    mismatch_token_clip_max: "--actor.mismatch_token_clip_max={value}"
    routing_replay: "--moe.routing_replay={value}"
    initial_model: "--init={value}"
"""


@pytest.fixture
def runs_log(tmp_path: Path) -> Path:
    return tmp_path / "runs.jsonl"


@pytest.fixture
def workspace(tmp_path: Path, training_checkout: Path, runs_log: Path) -> Path:
    """A workspace whose command backend is the trainer's own replay script, with its overrides mapped."""
    script = USER_REPLAY.replace("RUNS", repr(str(runs_log)))
    (training_checkout / "tools" / "user_replay.py").write_text(script)
    git(training_checkout, "add", ".")
    git(training_checkout, "commit", "-q", "-m", "the trainer's replay entry point")
    ws = tmp_path / "workspace"
    ws.mkdir()
    (ws / "spike-replay.yaml").write_text(
        "command_backend:\n"
        f"  workdir: {json.dumps(str(training_checkout))}\n"
        f'  command: "{sys.executable} tools/user_replay.py --snapshot {{snapshot}} --out {{out}} {{overrides}}"\n'
        + MAPPING
    )
    return ws


def replayed(request: ReplayRequest) -> ReplayResult:
    result = replay_elsewhere(request)
    assert isinstance(result, ReplayResult)
    return result


def runs(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def patch_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_checkout_untouched(checkout: Path) -> None:
    assert git(checkout, "status", "--porcelain") == ""
    assert len(git(checkout, "worktree", "list").splitlines()) == 1
    assert (checkout / "factor.txt").read_text() == "1.0\n"


def test_a_sweep_runs_the_baseline_once_and_judges_each_config_as_the_engine_does(
    workspace: Path, snapshot: Path, runs_log: Path
) -> None:
    open_task(workspace, "cmd-job", snapshot=snapshot)
    configs = [{"mismatch_token_clip_max": 2}, {"mismatch_token_clip_max": "0.01"}]
    sweep = replay_elsewhere(
        replay_request(
            What(snapshot, verb="sweep", configs=configs),
            where=Where(backend="command"),
            workspace=workspace,
        )
    )
    assert isinstance(sweep, SweepResult)

    # three runs of the trainer's command: the baseline (no override) once, then one per config
    assert runs(runs_log) == [
        ["--snapshot", str(snapshot), "--out", str(Path(sweep.output_dir) / "baseline" / "out")],
        ["--snapshot", str(snapshot), "--out", str(Path(sweep.output_dir) / "mismatch_token_clip_max=2" / "out"),
         "--actor.mismatch_token_clip_max=2"],
        ["--snapshot", str(snapshot), "--out", str(Path(sweep.output_dir) / "mismatch_token_clip_max=0.01" / "out"),
         "--actor.mismatch_token_clip_max=0.01"],
    ]  # fmt: skip
    base, clip2, clip001 = sweep.baseline, *sweep.results
    assert base.verdict is Verdict.REPRODUCED and base.grad_norm == RECORDED and base.config_id == "baseline"
    assert clip2.verdict is Verdict.PARTIAL and clip2.grad_norm == pytest.approx(RECORDED * 0.2)
    assert clip001.verdict is Verdict.CLEARED and clip001.change_vs_baseline == pytest.approx(0.001 - 1)
    assert {r.baseline_grad_norm for r in sweep.results} == {RECORDED}
    assert [r.config_id for r in sweep.results] == [config_id(parse_config(c)) for c in configs]
    assert all(r.backend is Backend.COMMAND for r in (base, *sweep.results))

    # the engine's output layout: one dir per config, each with its command, logs and result
    out = Path(sweep.output_dir)
    for result in (base, *sweep.results):
        folder = out / result.config_id
        assert {"command.txt", "stdout.log", "stderr.log", "replay_result.json"} <= {p.name for p in folder.iterdir()}
        assert ReplayResult.from_json(json.loads((folder / "replay_result.json").read_text())) == result
    assert SweepResult.from_json(json.loads((out / "sweep_result.json").read_text())).results == sweep.results

    # the task's rows: one per run, in the engine's vocabulary
    rows = read_state(workspace, "cmd-job").experiments
    assert [(r.config_id, r.verdict, r.is_baseline, r.backend) for r in rows] == [
        ("baseline", "reproduced", True, "command"),
        ("mismatch_token_clip_max=2", "partial", False, "command"),
        ("mismatch_token_clip_max=0.01", "cleared", False, "command"),
    ]
    assert rows[2].change == "mismatch_token_clip_max=0.01" and rows[2].mitigations == {"mismatch_token_clip_max": 0.01}

    # and the sweep writes up as a torch sweep does: a method file for the config that cleared
    (written,) = [w for w in write_up_sweep(workspace, "cmd-job", sweep) if w.path]
    assert written.config_id == "mismatch_token_clip_max=0.01"
    assert written.path is not None and "mismatch_token_clip_max" in Path(written.path).read_text()


def test_a_replay_with_a_mitigation_runs_the_baseline_then_the_override(
    workspace: Path, snapshot: Path, runs_log: Path
) -> None:
    request = replay_request(
        What(snapshot, mitigations={"routing_replay": "off"}),
        where=Where(backend="command"),
        workspace=workspace,
    )
    result = replayed(request)
    assert result.verdict is Verdict.WORSE and result.grad_norm == pytest.approx(RECORDED * 1.2)
    assert result.baseline_grad_norm == RECORDED and result.mitigations == {"routing_replay": "off"}
    assert [r[4:] for r in runs(runs_log)] == [[], ["--moe.routing_replay=off"]]
    baseline = json.loads((Path(result.output_dir) / "baseline" / "replay_result.json").read_text())
    assert baseline["verdict"] == "reproduced"


def test_an_unmapped_mitigation_is_refused_by_name_before_anything_runs(
    workspace: Path, snapshot: Path, runs_log: Path
) -> None:
    configs = [{"mismatch_token_clip_max": 2}, {"advantage_clip": 1, "kl_coef": 0}]
    with pytest.raises(ConfigError) as info:
        replay_elsewhere(
            replay_request(
                What(snapshot, verb="sweep", configs=configs),
                where=Where(backend="command"),
                workspace=workspace,
            )
        )
    message = str(info.value)
    assert info.value.parameter == "mitigations"
    assert message.startswith("`mitigations` advantage_clip, kl_coef: no override for them")
    assert "(mapped: initial_model, mismatch_token_clip_max, routing_replay)" in message
    assert runs(runs_log) == [] and not (workspace / "tmp").exists()
    # a value the mitigation's parser refuses never gets this far either
    with pytest.raises(ConfigError, match="mitigation mismatch_token_clip_max: must be > 0"):
        replay_request(
            What(snapshot, mitigations={"mismatch_token_clip_max": -1}),
            where=Where(backend="command"),
            workspace=workspace,
        )


def test_a_sweep_on_the_command_backend_reports_a_refused_value_in_its_place_and_logs_it(
    workspace: Path, snapshot: Path, runs_log: Path
) -> None:
    open_task(workspace, "cmd-job", snapshot=snapshot)
    configs = [{"mismatch_token_clip_max": -1}, {"mismatch_token_clip_max": 2}]
    sweep = replay_elsewhere(
        replay_request(
            What(snapshot, verb="sweep", configs=configs), where=Where(backend="command"), workspace=workspace
        )
    )
    assert isinstance(sweep, SweepResult)
    assert len(runs(runs_log)) == 2  # the baseline and the config that was not refused
    refused, clip = sweep.results
    assert clip.verdict is Verdict.PARTIAL and refused.verdict is Verdict.FAILED and refused.grad_norm is None
    assert refused.error == "refused: mitigation mismatch_token_clip_max: must be > 0, got -1"
    out = Path(sweep.output_dir)
    assert SweepResult.from_json(json.loads((out / "sweep_result.json").read_text())).results == sweep.results
    assert json.loads((out / refused.config_id / "replay_result.json").read_text())["error"] == refused.error
    state = read_state(workspace, "cmd-job")
    assert [f["reason"] for f in state.failed] == [refused.error]


def test_first_moe_layer_is_refused_before_anything_runs_even_when_mapped(
    workspace: Path, snapshot: Path, runs_log: Path
) -> None:
    config = workspace / "spike-replay.yaml"
    config.write_text(config.read_text() + '    current_routing_layers: "--moe.current_layers={value}"\n')
    configs = [{"mismatch_token_clip_max": 2}, {"current_routing_layers": "first"}]
    with pytest.raises(ConfigError, match="cannot tell which layer is its first MoE layer") as info:
        replay_elsewhere(
            replay_request(
                What(snapshot, verb="sweep", configs=configs),
                where=Where(backend="command"),
                workspace=workspace,
            )
        )
    assert info.value.parameter == "mitigations"
    assert runs(runs_log) == [] and not (workspace / "tmp").exists()


def test_two_patches_combine_in_order(
    workspace: Path, snapshot: Path, runs_log: Path, training_checkout: Path, tmp_path: Path
) -> None:
    a, b = patch_file(tmp_path, "a.diff", PATCH_A), patch_file(tmp_path, "b.diff", PATCH_B)
    result = replayed(
        replay_request(
            What(snapshot),
            where=Where(backend="command", patches=(a, b)),
            workspace=workspace,
        )
    )
    assert result.verdict is Verdict.CLEARED and result.grad_norm == pytest.approx(RECORDED * 0.01)
    both = (PATCH_A + PATCH_B).encode()
    assert result.patch_sha256 == hashlib.sha256(both).hexdigest()
    assert (Path(result.output_dir) / "patch.diff").read_bytes() == both  # what a method file quotes
    assert len(runs(runs_log)) == 1
    assert_checkout_untouched(training_checkout)


def test_a_second_patch_that_does_not_apply_fails_by_name_and_nothing_runs(
    workspace: Path, snapshot: Path, runs_log: Path, training_checkout: Path, tmp_path: Path
) -> None:
    a, stale = patch_file(tmp_path, "a.diff", PATCH_A), patch_file(tmp_path, "stale b.diff", PATCH)
    configs = [{"mismatch_token_clip_max": 2}]
    request = replay_request(
        What(snapshot, verb="sweep", configs=configs),
        where=Where(backend="command", patches=(a, stale)),
        workspace=workspace,
    )  # fmt: skip
    with pytest.raises(AxrlError) as info:
        replay_elsewhere(request)
    assert f"`patch` {stale} (patch 2 of 2): does not apply" in str(info.value)
    assert f"after {a}" in str(info.value) and "nothing was run" in str(info.value)
    assert runs(runs_log) == []  # not even the baseline
    assert_checkout_untouched(training_checkout)
    (written,) = (workspace / "tmp" / "spike-replay" / "cmd-job").glob("*/replay_result.json")
    doc = json.loads(written.read_text())
    assert doc["verdict"] == "failed" and "stale b.diff" in doc["error"] and doc["config_id"] == "sweep"


def test_a_value_with_shell_metacharacters_reaches_the_trainer_as_one_literal_word(
    workspace: Path, snapshot: Path, runs_log: Path, tmp_path: Path
) -> None:
    hostile = str(tmp_path / "init $(touch PWNED1); `touch PWNED2` | touch PWNED3 'q\" \\x")
    request = replay_request(
        What(snapshot, mitigations={"initial_model": hostile}),
        where=Where(backend="command"),
        workspace=workspace,
    )
    result = replayed(request)
    assert result.verdict is Verdict.NO_EFFECT  # this toy trainer ignores it
    assert runs(runs_log)[1][4:] == [f"--init={hostile}"]
    assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))


def test_the_cli_takes_repeated_patches_and_sweeps_on_the_command_backend(
    workspace: Path, snapshot: Path, runs_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = patch_file(tmp_path, "a.diff", PATCH_A), patch_file(tmp_path, "b.diff", PATCH_B)

    def cli(*args: str) -> tuple[int, str, str]:
        code = main([*args, "--workspace", str(workspace), "--json"])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = cli("replay", str(snapshot), "--backend", "command", "--patch", str(a), "--patch", str(b))
    assert code == 0, err
    assert json.loads(out)["grad_norm"] == pytest.approx(RECORDED * 0.01)
    args = ["--mitigation", "mismatch_token_clip_max=2", "--mitigation", "mismatch_token_clip_max=0.01"]
    code, out, err = cli("sweep", str(snapshot), "--backend", "command", *args)
    assert code == 0, err
    assert [r["verdict"] for r in json.loads(out)["results"]] == ["partial", "cleared"]
    assert len(runs(runs_log)) == 4
    code, out, err = cli("sweep", str(snapshot), "--backend", "command", "--mitigation", "advantage_clip=1")
    assert code == 2 and "--mitigation advantage_clip: no override" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("mapping", "says"),
    [
        ('    not_a_knob: "--x={value}"\n', "not_a_knob' is not a mitigation; known: mismatch_token_clip_max"),
        ('    advantage_clip: "--clip"\n', "put {value} where the value goes"),
        ('    advantage_clip: "--clip={val}"\n', "unknown placeholder {val}; use {value}"),
        ('    advantage_clip: "--clip=\'{value}"\n', "cannot split it into words"),
    ],
)
def test_a_bad_mapping_is_refused_with_the_key(mapping: str, says: str) -> None:
    doc = "command_backend:\n  workdir: /w\n  command: 'run {snapshot} {overrides}'\n  mitigations:\n" + mapping
    with pytest.raises(ConfigError, match=r"command_backend\.mitigations") as info:
        parse_workspace_config(yaml.safe_load(doc), "ws.yaml")
    assert says in str(info.value)


def test_a_mapping_needs_the_overrides_placeholder_in_the_command() -> None:
    doc = {
        "command_backend": {"workdir": "/w", "command": "run {snapshot}", "mitigations": {"kl_coef": "--kl={value}"}}
    }
    with pytest.raises(ConfigError, match=r"needs \{overrides\} in command_backend.command"):
        parse_workspace_config(doc, "ws.yaml")
