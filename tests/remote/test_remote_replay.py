"""Replaying on a GPU node over SSH gives the same numbers as here, with the output brought home."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ssh_loopback import SSHD, LoopbackServer

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.result import ReplayResult, SweepResult
from axrl_spike_replay.investigation.elsewhere import replay_elsewhere
from axrl_spike_replay.investigation.request import How, ReplayRequest, What, Where, replay_request
from axrl_spike_replay.investigation.runs import run_request

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
SNAPSHOT = FIXTURE / "checkpoints" / "spike_snapshots" / "iter_0000021"


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest) -> LoopbackServer:
    """The most realistic loopback node available: OpenSSH's sshd, else the asyncssh server."""
    return request.getfixturevalue("openssh_server" if SSHD else "asyncssh_server")


@pytest.fixture(scope="module")
def local_baseline(tmp_path_factory: pytest.TempPathFactory) -> ReplayResult:
    if not SNAPSHOT.is_dir():
        pytest.skip("fixture snapshot missing (scripts/make_fixtures.py)")
    return run_request(replay_request(What(SNAPSHOT), workspace=tmp_path_factory.mktemp("local-ws")))


def remote(
    node: LoopbackServer,
    workspace: Path,
    what: What | None = None,
    how: How | None = None,
    timeout_s: float | None = None,
    **recorded: object,
) -> ReplayRequest:
    where = Where(target=node.spec(), remote_python=sys.executable, timeout_s=timeout_s)
    return replay_request(what or What(SNAPSHOT), where, how, workspace=workspace, **recorded)  # type: ignore[arg-type]


def test_a_remote_replay_matches_the_local_one_exactly(
    node: LoopbackServer, local_baseline: ReplayResult, tmp_path: Path
) -> None:
    progress: list[str] = []
    options = remote(node, tmp_path, progress=progress.append)
    result = replay_elsewhere(options)
    assert isinstance(result, ReplayResult)
    assert result.grad_norm == local_baseline.grad_norm  # exactly: same engine, same layout, same arithmetic
    assert result.verdict == "reproduced" and result.fidelity == "full" and result.world_size_used == 2
    assert result.target == node.spec() and result.node["gpu_count"] == 0 and result.node["hostname"]
    out = Path(result.output_dir)
    assert out.parent == tmp_path / "tmp" / "spike-replay" / local_baseline.job_name
    for name in ("command.txt", "stdout.log", "stderr.log", "replay_result.json", "replay.log"):
        assert (out / name).is_file(), name
    written = json.loads((out / "replay_result.json").read_text())
    assert written["target"] == node.spec() and written["node"]["gpu_count"] == 0
    assert written["output_dir"] == str(out)
    assert "-m axrl_spike_replay replay" in (out / "command.txt").read_text()
    assert any("baseline: grad norm" in line for line in progress)  # the node's progress, streamed


def test_a_remote_sweep_brings_every_result_home(
    node: LoopbackServer, local_baseline: ReplayResult, tmp_path: Path
) -> None:
    configs = [{"advantage_clip": 0.5}, {"mismatch_token_clip_max": 2.0}]
    result = replay_elsewhere(remote(node, tmp_path, What(SNAPSHOT, verb="sweep", configs=configs)))
    assert isinstance(result, SweepResult) and len(result.results) == 2
    assert result.baseline.grad_norm == local_baseline.grad_norm
    out = Path(result.output_dir)
    assert json.loads((out / "sweep_result.json").read_text())["output_dir"] == str(out)
    for r in (result.baseline, *result.results):
        doc = json.loads((out / r.config_id / "replay_result.json").read_text())
        assert doc["target"] == node.spec() and doc["grad_norm"] == r.grad_norm and doc["node"]["gpu_count"] == 0
    assert {r.mitigations.get("advantage_clip") for r in result.results} == {0.5, None}


def test_a_remote_timeout_is_a_failed_result_with_partial_logs(node: LoopbackServer, tmp_path: Path) -> None:
    with pytest.raises(AxrlError, match=r"timed out after 0\.5 s") as info:
        replay_elsewhere(remote(node, tmp_path, timeout_s=0.5))
    written = next((tmp_path / "tmp" / "spike-replay").glob("*/*/replay_result.json"))
    doc = json.loads(written.read_text())
    assert doc["verdict"] == "failed" and "timed out" in doc["error"] and doc["grad_norm"] is None
    assert (written.parent / "stderr.log").exists() and str(written.parent) in str(info.value)


def test_cuda_on_a_node_without_gpus_is_refused_before_running(node: LoopbackServer, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no GPU"):
        replay_elsewhere(remote(node, tmp_path, how=How(device="cuda")))
