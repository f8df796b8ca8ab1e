"""An external replay command (AXRL's reproduce_spike) run on the node or here, and patch-based experiments."""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path

import pytest
from remote_helpers import PATCH, RECORDED, SLOW_SCRIPT, git, wait_until_gone, workspace_with

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.elsewhere import replay_elsewhere
from axrl_spike_replay.investigation.request import What, Where, replay_request


def run_dir_of(result: ReplayResult) -> Path:
    return Path(result.output_dir)


@pytest.mark.parametrize("where", ["local", "asyncssh", "openssh"])
def test_the_external_command_reproduces_the_spike(
    where: str, request: pytest.FixtureRequest, training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    server = None if where == "local" else request.getfixturevalue(f"{where}_server")
    ws = workspace_with(tmp_path, training_checkout, server)
    options = replay_request(
        What(snapshot),
        where=Where(backend="command", target="local" if server is None else "loop"),
        workspace=ws,
    )
    result = replay_elsewhere(options)
    assert result.backend == "command" and result.verdict == "reproduced"
    assert result.grad_norm == RECORDED and result.rel_diff == 0.0
    assert result.target == ("local" if server is None else "loop")
    if server is not None:
        assert result.node["gpu_count"] == 0  # loopback: no nvidia-smi here
    out = run_dir_of(result)
    assert out.parent == ws / "tmp" / "spike-replay" / "cmd-job"
    assert "reproduce_spike: iteration 21" in (out / "stdout.log").read_text()
    assert (out / "stderr.log").exists() and "tools/reproduce_spike.py" in (out / "command.txt").read_text()
    assert json.loads((out / "replay_result.json").read_text())["grad_norm"] == RECORDED
    assert not list(tmp_path.rglob("PWNED"))


def test_the_grad_norm_regex_reads_stdout_when_no_result_file(
    training_checkout: Path, snapshot: Path, tmp_path
) -> None:
    ws = workspace_with(tmp_path, training_checkout, None, extra=" --no-json")
    result = replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command"), workspace=ws))
    assert result.grad_norm == RECORDED and result.verdict == "reproduced"


@pytest.mark.parametrize("where", ["local", "openssh"])
def test_a_patched_experiment_never_touches_the_checkout(
    where: str, request: pytest.FixtureRequest, training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    server = None if where == "local" else request.getfixturevalue(f"{where}_server")
    ws = workspace_with(tmp_path, training_checkout, server)
    patch = tmp_path / "lower factor.diff"
    patch.write_text(PATCH)
    options = replay_request(
        What(snapshot),
        where=Where(backend="command", target="local" if server is None else "loop", patches=(patch,)),
        workspace=ws,
    )
    result = replay_elsewhere(options)
    assert result.verdict == "cleared"  # 56.75 * 0.001 / median 0.5 is under the threshold
    assert result.grad_norm == pytest.approx(RECORDED * 0.001)
    assert result.baseline_grad_norm == RECORDED and result.patch_sha256 is not None
    assert len(result.patch_sha256) == 64 and result.config_id == f"patch-{result.patch_sha256[:12]}"
    assert git(training_checkout, "status", "--porcelain") == ""
    assert len(git(training_checkout, "worktree", "list").splitlines()) == 1
    assert (training_checkout / "factor.txt").read_text() == "1.0\n"


def test_a_patch_that_does_not_apply_fails_cleanly(training_checkout: Path, snapshot: Path, tmp_path: Path) -> None:
    ws = workspace_with(tmp_path, training_checkout, None)
    patch = tmp_path / "stale.diff"
    patch.write_text(PATCH.replace("-1.0", "-2.0"))
    with pytest.raises(AxrlError, match="does not apply") as info:
        replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command", patches=(patch,)), workspace=ws))
    assert "git apply --check" in str(info.value)
    assert git(training_checkout, "status", "--porcelain") == ""
    assert len(git(training_checkout, "worktree", "list").splitlines()) == 1
    written = next((ws / "tmp" / "spike-replay" / "cmd-job").glob("*/replay_result.json"))
    doc = json.loads(written.read_text())
    assert doc["verdict"] == "failed" and "does not apply" in doc["error"] and doc["patch_sha256"]


def test_a_failing_command_is_a_failed_result_with_its_stderr(
    training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    ws = workspace_with(tmp_path, training_checkout, None, extra=" --bogus-flag")
    with pytest.raises(AxrlError, match="exit status 2") as info:
        replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command"), workspace=ws))
    assert "unrecognized arguments: --bogus-flag" in str(info.value)


def test_refused_combinations_say_what_to_do(training_checkout: Path, snapshot: Path, tmp_path: Path) -> None:
    ws = workspace_with(tmp_path, training_checkout, None)
    with pytest.raises(ConfigError, match="express the change as `patch`"):
        replay_elsewhere(
            replay_request(
                What(snapshot, mitigations={"advantage_clip": 1}),
                where=Where(backend="command"),
                workspace=ws,
            )
        )
    with pytest.raises(ConfigError, match="add `backend` command"):
        replay_elsewhere(replay_request(What(snapshot), where=Where(target="loop", patches=("x.diff",)), workspace=ws))
    (ws / "spike-replay.yaml").write_text("targets: {}\n")
    with pytest.raises(ConfigError, match="needs a command_backend section"):
        replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command"), workspace=ws))


def test_setting_the_cancel_event_stops_a_run_from_another_thread(
    training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    """How a thread-based caller (an MCP worker thread) stops a run: the request's cancel event."""
    marker = f"axrl-event-{secrets.token_hex(6)}"
    (training_checkout / "tools" / "slow_replay.py").write_text(SLOW_SCRIPT)
    ws = workspace_with(tmp_path, training_checkout, None)
    config = (ws / "spike-replay.yaml").read_text()
    (ws / "spike-replay.yaml").write_text(config.replace("tools/reproduce_spike.py", f"tools/slow_replay.py {marker}"))
    cancel, errors = threading.Event(), []

    def work() -> None:
        try:
            replay_elsewhere(
                replay_request(
                    What(snapshot),
                    where=Where(backend="command"),
                    workspace=ws,
                    cancel=cancel,
                )
            )
        except AxrlError as exc:
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    runs = ws / "tmp" / "spike-replay" / "cmd-job"
    deadline = time.monotonic() + 60
    while not any("started" in p.read_text() for p in runs.glob("*/stdout.log")):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    cancel.set()
    thread.join(60)
    assert errors and "cancelled" in str(errors[0])
    assert wait_until_gone(marker) == []
    assert json.loads(next(runs.glob("*/replay_result.json")).read_text())["verdict"] == "failed"
