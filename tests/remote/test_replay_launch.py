"""The replay launched by torchrun: the same outcomes as our spawn launcher, bit for bit; a world-size-2 capture
replayed over two nodes (two torchrun agents through the real loopback sshd) reproduces the spike; the run lands
in the workspace through the one recorder; and every failure names the node and leaves no process behind."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from launch_helpers import wait_until_untagged
from replay_launch_helpers import (
    ONE_WORKER,
    SNAPSHOT,
    blind_node,
    copy_snapshot,
    node_entry,
    pair,
    replay_workers,
    wait_for_workers,
    write_workspace,
)
from ssh_loopback import LoopbackServer, TcpProxy, write_known_hosts

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.experiment.request.request_parts import MAX_REPEAT
from axrl_spike_replay.experiment.result import ReplayResult, SweepResult
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.remote.launchers.launch_job import LaunchNode
from axrl_spike_replay.remote.launchers.replay_launch import LaunchedRunner, Placement
from axrl_spike_replay.replay.compute.clean_gradient import spike_bar
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.jobs.job_runner import run_job
from axrl_spike_replay.replay.plans.layout_plan import plan_layout
from axrl_spike_replay.replay.reading.inputs import load_inputs

pytestmark = [pytest.mark.slow, ONE_WORKER]
CONFIGS = [{"advantage_clip": 0.5}, {"drop_samples": "1:0"}, {"routing_replay": "off", "kl_coef": 0.02}]


def _job(snapshot: Path, configs: list[dict]) -> WorkerJob:
    inputs = load_inputs(snapshot, snapshot, False)
    applied = [apply_config({}, inputs.loss, inputs.routing)]
    applied += [apply_config(parse_config(c), inputs.loss, inputs.routing, inputs.model.moe_layer_ids) for c in configs]
    return WorkerJob(
        replay_dir=str(snapshot),
        model=inputs.model,
        configs=tuple(applied),
        world_size=inputs.world_size,
        assignment=plan_layout(inputs.world_size).assignment,
        counts=inputs.counts,
        spike_bar=spike_bar(inputs.metadata.median_norm, 5.0),
    )


def _figures(outcome: object) -> dict:
    doc = dataclasses.asdict(outcome)  # type: ignore[call-overload]
    doc.pop("timings")
    return doc


@pytest.fixture(scope="module")
def spawned() -> list[ConfigOutcome]:
    """The outcomes of _job(SNAPSHOT, CONFIGS) from our spawn launcher, whole model: the launched runs' reference."""
    return run_job(_job(SNAPSHOT, CONFIGS))


def test_torchrun_gives_the_spawn_launchers_outcomes_bit_for_bit(spawned: list[ConfigOutcome]) -> None:
    job = _job(SNAPSHOT, CONFIGS)
    runner = LaunchedRunner(Placement("here", nodes=(LaunchNode("here"),), nproc_per_node=2))
    said: list[str] = []
    launched = runner(job, progress=said.append)
    assert [o.config_id for o in launched] == [c.config_id for c in job.configs]
    for a, b in zip(spawned, launched, strict=True):
        assert _figures(b) == _figures(a), a.config_id  # grad norms, top params, rank metrics, clean gradient
    assert launched[0].grad_norms == spawned[0].grad_norms and launched[1].clean_gradient is not None
    assert runner.last is not None and runner.last.launcher == "torchrun"
    assert {p["rank"] for p in runner.last.result["processes"]} == {0, 1}
    assert launched[0].timings["launch"] >= launched[0].timings["launch_start"] > 0
    assert any("baseline computed" in line for line in said)  # the workers' progress, streamed
    assert replay_workers() == {}


@pytest.fixture
def two_nodes(openssh_server: LoopbackServer, tmp_path: Path) -> Path:
    """A workspace naming two loopback nodes and the `pair` of them."""
    nodes = {"node-a": node_entry(openssh_server), "node-b": node_entry(openssh_server)}
    return write_workspace(tmp_path / "ws", nodes, multinode={"pair": pair()})


def test_a_world_size_2_capture_replays_over_two_nodes_and_reproduces(
    two_nodes: Path, tmp_path: Path, local_replay: ReplayResult
) -> None:
    local = local_replay
    said: list[str] = []
    request = replay_request(What(SNAPSHOT), Where(target="pair"), workspace=two_nodes, progress=said.append)
    result = run_request(request)
    assert isinstance(result, ReplayResult)
    assert result.verdict == "reproduced" and result.fidelity == "full" and result.world_size_used == 2
    assert result.grad_norm == local.grad_norm  # exactly: the same engine, layout and arithmetic
    assert result.target == "pair" and result.node is not None
    node = result.node
    assert node["launcher"] == "torchrun" and node["nodes"] == ["node-a", "node-b"]
    assert node["rendezvous"].startswith("127.0.0.1:") and sorted(p["rank"] for p in node["processes"]) == [0, 1]
    out = Path(result.output_dir)
    assert out.parent == two_nodes / "tmp" / "spike-replay" / local.job_name
    written = json.loads((out / "replay_result.json").read_text())
    assert written["target"] == "pair" and written["node"]["launcher"] == "torchrun"
    assert "--target pair" in (out / "command.txt").read_text()
    launch = out / "launch"
    assert (launch / "command.txt").read_text().count("--rdzv-backend c10d") == 2
    assert {p.name for p in launch.glob("node*.stderr.log")} == {"node0-node-a.stderr.log", "node1-node-b.stderr.log"}
    computed = [line.split("]")[0] for line in said if "baseline computed" in line]
    assert sorted(computed) == ["[node-a", "[node-b"]  # each node's process, its progress streamed here
    assert wait_until_untagged(node["launch_id"]) == []


def test_several_targets_run_one_sweep_as_one_job(two_nodes: Path) -> None:
    what = What(SNAPSHOT, verb="sweep", configs=tuple(CONFIGS[:2]))
    result = run_request(replay_request(what, Where(targets=("node-a", "node-b")), workspace=two_nodes))
    assert isinstance(result, SweepResult) and len(result.results) == 2
    assert result.baseline.verdict == "reproduced" and result.world_size_used == 2
    for r in (result.baseline, *result.results):
        doc = json.loads((Path(result.output_dir) / r.config_id / "replay_result.json").read_text())
        assert doc["target"] == "node-a+node-b" and doc["node"]["nodes"] == ["node-a", "node-b"]
    assert result.results[0].verdict in ("cleared", "partial", "no_effect", "worse")


def test_nproc_that_does_not_spread_over_the_nodes_is_refused_before_anything_starts(two_nodes: Path) -> None:
    request = replay_request(What(SNAPSHOT), Where(target="pair"), How(nproc=1), workspace=two_nodes)
    with pytest.raises(AxrlError, match=r"`nproc` 1 does not spread evenly over the 2 node\(s\) of pair"):
        run_request(request)
    assert not (two_nodes / "tmp").exists()


def test_a_node_without_torch_or_the_package_is_named(openssh_server: LoopbackServer, tmp_path: Path) -> None:
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no system python3 to stand for a node without torch")
    nodes = {"node-a": node_entry(openssh_server), "bare": node_entry(openssh_server, python="/usr/bin/python3")}
    ws = write_workspace(tmp_path / "ws", nodes, multinode={"pair": pair(nodes=("node-a", "bare"))})
    with pytest.raises(AxrlError) as caught:
        run_request(replay_request(What(SNAPSHOT), Where(target="pair"), workspace=ws))
    message = str(caught.value)
    assert "node 'bare'" in message and "torch is not importable with /usr/bin/python3" in message
    assert "axrl-spike-replay node TARGET --install" in message and "Traceback" not in message
    result = json.loads(next((ws / "tmp").rglob("replay_result.json")).read_text())
    assert result["verdict"] == "failed" and "'bare'" in result["error"] and result["grad_norm"] is None
    assert not list((ws / "tmp").rglob("launch/node*.stderr.log"))  # refused before any agent started
    assert replay_workers() == {}


def test_a_node_that_does_not_see_the_snapshot_is_named_before_anything_starts(
    openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    snapshot = copy_snapshot(tmp_path)
    # node-b: an sshd in its own mount namespace, where an empty dir hides the snapshot (no shared storage there)
    blind, server_b = blind_node(tmp_path, openssh_server, snapshot)
    try:
        nodes = {"node-a": node_entry(openssh_server), "node-b": node_entry(server_b)}
        ws = write_workspace(tmp_path / "ws", nodes, multinode={"pair": pair()})
        with pytest.raises(AxrlError) as caught:
            run_request(replay_request(What(snapshot), Where(target="pair"), workspace=ws))
    finally:
        blind.stop()
    message = str(caught.value)
    assert "node 'node-b'" in message and "does not see the snapshot as this machine does" in message
    assert f"{snapshot}/.metadata: No such file or directory" in message and "shared storage" in message
    assert "node-a" not in message.split("(see")[0]
    assert not list((ws / "tmp").rglob("launch/node*.stderr.log")) and replay_workers() == {}


def test_a_rendezvous_that_times_out_names_the_node_that_never_started(
    openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    probed = tmp_path / "probed"
    hang = f"if [ -e {probed} ]; then sleep 600; fi; touch {probed}"  # answers the probe, then hangs in setup
    nodes = {"node-a": node_entry(openssh_server), "node-b": node_entry(openssh_server, setup=(hang,))}
    ws = write_workspace(tmp_path / "ws", nodes, multinode={"pair": pair(rendezvous_timeout_s=4.0)})
    with pytest.raises(AxrlError) as caught:
        run_request(replay_request(What(SNAPSHOT), Where(target="pair"), workspace=ws))
    message = str(caught.value)
    assert "did not complete within 4 s" in message and "'node-b' never started a torchrun agent" in message
    assert "Traceback" not in message
    result = json.loads(next((ws / "tmp").rglob("replay_result.json")).read_text())
    assert result["verdict"] == "failed" and result["grad_norm"] is None
    assert replay_workers() == {} and _sleepers(probed) == []


def _sleepers(marker: Path) -> list[str]:
    got = subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True, text=True, check=False)
    return [pid for pid in got.stdout.split() if Path(f"/proc/{pid}").exists() and marker.parent.exists()]


def _long_replay(ws: Path, where: Where, cancel: threading.Event | None = None) -> tuple[threading.Thread, list]:
    """A replay that keeps its workers busy (the most repeats allowed: seconds) in a thread; its outcome lands in
    the list."""
    ended: list = []
    request = replay_request(What(SNAPSHOT, repeat=MAX_REPEAT), where, workspace=ws, cancel=cancel)

    def work() -> None:
        try:
            ended.append(run_request(request))
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, ended


def test_a_node_that_dies_mid_replay_ends_the_job_naming_it(openssh_server: LoopbackServer, tmp_path: Path) -> None:
    proxy = TcpProxy(openssh_server.port)
    try:
        kh = write_known_hosts(tmp_path / "kh", proxy.port, openssh_server.keys.host_pub)
        via_proxy = LoopbackServer("openssh", proxy.port, openssh_server.user, openssh_server.keys, kh)
        nodes = {"node-a": node_entry(openssh_server), "node-b": node_entry(via_proxy)}
        ws = write_workspace(tmp_path / "ws", nodes, multinode={"pair": pair()})
        thread, ended = _long_replay(ws, Where(target="pair"))
        launch_id = wait_for_workers(2, lambda: bool(ended))
        proxy.drop()  # node-b's connection is gone, as when the node dies
        thread.join(120)
    finally:
        proxy.close()
    assert ended and isinstance(ended[0], AxrlError), ended
    message = str(ended[0])
    assert "node 'node-b' failed" in message and "lost" in message
    assert wait_until_untagged(launch_id, 30.0) == []
    result = json.loads(next((ws / "tmp").rglob("replay_result.json")).read_text())
    assert result["verdict"] == "failed" and "node-b" in result["error"]


def test_cancel_and_timeout_end_the_job_on_every_node(two_nodes: Path) -> None:
    cancel = threading.Event()
    thread, ended = _long_replay(two_nodes, Where(target="pair"), cancel)
    launch_id = wait_for_workers(2, lambda: bool(ended))
    cancel.set()  # as a cancelled MCP call does
    thread.join(120)
    assert ended and isinstance(ended[0], AxrlError) and "cancelled" in str(ended[0]), ended
    assert wait_until_untagged(launch_id) == []
    results = [json.loads(p.read_text()) for p in (two_nodes / "tmp").rglob("replay_result.json")]
    assert [r["verdict"] for r in results] == ["failed"] and "cancelled" in results[0]["error"]

    thread, ended = _long_replay(two_nodes, Where(target="pair", timeout_s=6.0))  # far less than the repeats take
    thread.join(180)
    assert ended and isinstance(ended[0], AxrlError), ended
    assert "did not finish within 6 s; it was stopped on every node" in str(ended[0])
    assert replay_workers() == {}


def test_a_cuda_replay_on_nodes_without_gpus_is_refused_before_anything_starts(two_nodes: Path) -> None:
    request = replay_request(What(SNAPSHOT), Where(target="pair"), How(device="cuda"), workspace=two_nodes)
    with pytest.raises(AxrlError, match=r"`device` cuda: node 'node-a' has no GPU \(nvidia-smi: "):
        run_request(request)
    assert not (two_nodes / "tmp").exists() and replay_workers() == {}


def test_plan_against_a_target_probes_its_gpus(two_nodes: Path, capsys: pytest.CaptureFixture) -> None:
    from axrl_spike_replay.cli import main

    argv = ["plan", str(SNAPSHOT), "--workspace", str(two_nodes), "--json"]
    assert main([*argv, "--target", "pair", "--device", "cuda"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["capacity"]["where"] == "node-a" and doc["capacity"]["devices"] == 0 and doc["fits"] is False
    assert "multinode entry 'pair': node-a probed; its other 1 node(s) taken to be alike" in doc["notes"]
    assert main([*argv, "--target", "node-b"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["capacity"] is None and doc["fits"] is None and doc["chosen"]["nproc"] == 2
    assert "node-b: a CPU replay's memory there is not probed; capacity unknown" in doc["notes"]


def test_a_sharded_job_launched_by_torchrun_gives_the_spawned_sharded_outcomes(
    spawned: list[ConfigOutcome],
) -> None:
    job = dataclasses.replace(_job(SNAPSHOT, CONFIGS), shard=True)  # FSDP2 over the two launched processes
    spawned_sharded = run_job(job)
    runner = LaunchedRunner(Placement("here", nodes=(LaunchNode("here"),), nproc_per_node=2))
    launched = runner(job)
    for a, b in zip(spawned_sharded, launched, strict=True):
        assert _figures(b) == _figures(a), a.config_id
    whole = spawned  # the same job, each process holding the whole model
    assert abs(launched[0].grad_norms[0] - whole[0].grad_norms[0]) <= 1e-6 * whole[0].grad_norms[0]
    assert replay_workers() == {}


def test_a_worker_that_would_abort_while_finalizing_leaves_the_job_done(
    spawned: list[ConfigOutcome], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its work a worker leaves without the interpreter's finalization, where gloo's threads can abort a
    process that is done: a worker whose finalization would abort (planted as an atexit handler) ends the job well."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(
        "import atexit, os\nif os.environ.get('LOCAL_RANK') == '1':\n    atexit.register(os.abort)\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(planted), os.environ.get("PYTHONPATH")])))
    runner = LaunchedRunner(Placement("here", nodes=(LaunchNode("here"),), nproc_per_node=2))

    launched = runner(_job(SNAPSHOT, CONFIGS))

    assert [_figures(o) for o in launched] == [_figures(o) for o in spawned]
