"""torchrun on loopback: two agents started through the real OpenSSH sshd (two targets = two nodes) meet at one
c10d rendezvous on 127.0.0.1 and run a real gloo all-reduce; failures name the node and leave no process."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
from pathlib import Path

import pytest
from launch_helpers import WORKER, ssh_node, tagged_processes, wait_for_files, wait_until_untagged
from ssh_loopback import LoopbackServer, TcpProxy, free_port, write_known_hosts

from axrl_spike_replay.remote.launchers.launch_job import LaunchError, LaunchNode, new_launch_id
from axrl_spike_replay.remote.launchers.torchrun_launch import TorchrunJob, launch_torchrun

pytestmark = pytest.mark.slow
RDZV_TIMEOUT_S = 20.0


def two_node_job(server: LoopbackServer, payload: dict | None = None, **knobs: object) -> TorchrunJob:
    a_setup = knobs.pop("a_setup", ())
    b_setup = knobs.pop("b_setup", ())
    b_server = knobs.pop("b_server", server)
    assert isinstance(a_setup, tuple) and isinstance(b_setup, tuple) and isinstance(b_server, LoopbackServer)
    return TorchrunJob(
        nodes=(ssh_node("node-a", server, *a_setup), ssh_node("node-b", b_server, *b_setup)),
        worker=WORKER,
        nproc_per_node=1,
        payload=payload or {},
        rendezvous_timeout_s=knobs.pop("rendezvous_timeout_s", RDZV_TIMEOUT_S),  # type: ignore[arg-type]
        timeout_s=knobs.pop("timeout_s", 120.0),  # type: ignore[arg-type]
    )


def test_two_agents_over_ssh_meet_at_one_rendezvous_and_rank0_result_comes_back(
    openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    launch_id = new_launch_id()
    said: list[str] = []
    outcome = asyncio.run(
        launch_torchrun(two_node_job(openssh_server), tmp_path / "out", launch_id=launch_id, progress=said.append)
    )
    result = outcome.result
    assert result["sum"] == 3.0 and result["world_size"] == 2  # 1 + 2 over both nodes' processes
    processes = result["processes"]
    assert sorted(p["group_rank"] for p in processes) == [0, 1]  # one process on each node
    assert {p["launch_tag"] for p in processes} == {launch_id}
    assert result["master_addr"] == "127.0.0.1"
    assert outcome.rendezvous is not None and outcome.rendezvous.startswith("127.0.0.1:")
    assert outcome.nodes == ("node-a", "node-b") and outcome.launcher == "torchrun"
    assert json.loads(outcome.result_path.read_text()) == result
    assert outcome.result_path.parent == tmp_path / "out"
    command = (tmp_path / "out" / "command.txt").read_text()
    assert command.count("--rdzv-backend c10d") == 2 and command.count("--nnodes 2") == 2
    assert "is_host=1" in command and "is_host=0" in command
    assert not any(Path(p["request_path"]).parent.exists() for p in processes)  # node temp dirs removed
    assert wait_until_untagged(launch_id) == []
    assert 0 < outcome.start_s <= outcome.seconds


def test_one_node_runs_standalone_here(tmp_path: Path) -> None:
    job = TorchrunJob(nodes=(LaunchNode("here"),), worker=WORKER, nproc_per_node=2, timeout_s=120.0)
    launch_id = new_launch_id()
    outcome = asyncio.run(launch_torchrun(job, tmp_path / "out", launch_id=launch_id))
    assert outcome.result["sum"] == 3.0 and outcome.result["world_size"] == 2
    assert sorted(p["local_rank"] for p in outcome.result["processes"]) == [0, 1]
    assert outcome.rendezvous is None and "--standalone" in (tmp_path / "out" / "command.txt").read_text()
    assert wait_until_untagged(launch_id) == []


def test_a_node_without_torch_is_refused_before_anything_starts(openssh_server: LoopbackServer, tmp_path: Path) -> None:
    job = TorchrunJob(
        nodes=(ssh_node("node-a", openssh_server), ssh_node("bare", openssh_server, python="/usr/bin/python3")),
        worker=WORKER,
    )
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no system python3 to stand for a node without torch")
    with pytest.raises(LaunchError) as caught:
        asyncio.run(launch_torchrun(job, tmp_path / "out"))
    message = str(caught.value)
    assert caught.value.node == "bare" and "'bare'" in message and "node-a" not in message
    assert "torch is not importable with /usr/bin/python3" in message and "install torch" in message
    assert "axrl-spike-replay node TARGET --install" in message  # nor is the package
    assert not (tmp_path / "out" / "command.txt").exists()  # refused before any agent started


def test_a_node_that_cannot_be_reached_is_named_and_the_others_closed(
    openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    nowhere = LoopbackServer(
        "openssh", free_port(), openssh_server.user, openssh_server.keys, openssh_server.known_hosts
    )
    job = two_node_job(openssh_server, b_server=nowhere)
    with pytest.raises(LaunchError) as caught:
        asyncio.run(launch_torchrun(job, tmp_path / "out"))
    assert caught.value.node == "node-b" and str(caught.value).startswith("node 'node-b': cannot connect: ")
    assert "connection refused" in str(caught.value)


def test_a_node_whose_agent_never_starts_times_out_the_rendezvous_by_name(
    openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    marker = f"axrl-hang-{secrets.token_hex(4)}"
    probed = tmp_path / "probed"
    # node-b answers the probe, then hangs in its setup line when its agent is to start (a stuck mount, say)
    hang = f"if [ -e {probed} ]; then python3 -c 'import time; time.sleep(600)' {marker}; fi; touch {probed}"
    job = two_node_job(openssh_server, b_setup=(hang,), rendezvous_timeout_s=4.0)
    launch_id = new_launch_id()
    with pytest.raises(LaunchError) as caught:
        asyncio.run(launch_torchrun(job, tmp_path / "out", launch_id=launch_id))
    message = str(caught.value)
    assert caught.value.node == "node-b"
    assert "did not complete within 4 s" in message and "'node-b' never started a torchrun agent" in message
    assert "node-a" not in message.split("never started")[0].split("node(s)")[-1]
    assert wait_until_untagged(launch_id) == [] and _processes(marker) == []
    assert not (tmp_path / "out" / "result.json").exists()


def test_a_node_that_drops_off_mid_run_ends_the_job_with_its_name(
    openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    proxy = TcpProxy(openssh_server.port)
    via_proxy = LoopbackServer("openssh", proxy.port, openssh_server.user, openssh_server.keys, tmp_path / "kh")
    write_known_hosts(tmp_path / "kh", proxy.port, openssh_server.keys.host_pub)
    ready = tmp_path / "ready"
    ready.mkdir()
    payload = {"ready_dir": str(ready), "gate": str(tmp_path / "never")}
    launch_id = new_launch_id()

    async def story() -> None:
        task = asyncio.ensure_future(
            launch_torchrun(
                two_node_job(openssh_server, payload, b_server=via_proxy), tmp_path / "out", launch_id=launch_id
            )
        )
        await wait_for_files(ready, 2, task)
        proxy.drop()  # node-b's connection is gone, as when the node dies
        await task

    try:
        with pytest.raises(LaunchError) as caught:
            asyncio.run(story())
    finally:
        proxy.close()
    assert caught.value.node == "node-b"
    assert "node 'node-b' failed" in str(caught.value) and "lost" in str(caught.value)
    assert wait_until_untagged(launch_id, 30.0) == []  # node-b's sshd saw its client go: its watchdog ended them
    assert not (tmp_path / "out" / "result.json").exists()
    a_dir, b_dir = (Path(_request(tmp_path / "out", n)["result_path"]).parent for n in ("node0", "node1"))
    assert not a_dir.exists()  # cleaned on the node still reachable
    shutil.rmtree(b_dir)  # a dead node keeps its temp dir; here the "node" is this machine


def _request(out: Path, stem: str) -> dict:
    return json.loads(next(out.glob(f"{stem}-*.request.json")).read_text())


def test_a_worker_that_crashes_fails_the_job_naming_its_node(openssh_server: LoopbackServer, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    payload = {"ready_dir": str(ready), "gate": str(tmp_path / "never")}  # node-a's worker waits; node-b's crashes
    job = two_node_job(openssh_server, payload, b_setup=("export AXRL_TEST_CRASH=1",))
    launch_id = new_launch_id()
    with pytest.raises(LaunchError) as caught:
        asyncio.run(launch_torchrun(job, tmp_path / "out", launch_id=launch_id))
    message = str(caught.value)
    assert caught.value.node == "node-b" and "node 'node-b' failed: exit status 1" in message
    assert "exitcode : 3" in " ".join(message.split())  # the tail of its agent's output: torchrun's summary
    assert wait_until_untagged(launch_id) == []
    assert not (tmp_path / "out" / "result.json").exists()


@pytest.fixture
def short_graces(monkeypatch: pytest.MonkeyPatch) -> None:
    """TERM then KILL after 1 s, not 5: the agent's process group and the sweep still need the KILL for workers
    that ignore TERM, and the test waits a second for each, not five."""
    from axrl_spike_replay.remote.launchers import torchrun_launch
    from axrl_spike_replay.remote.transport import session

    monkeypatch.setattr(session, "KILL_GRACE_S", 1.0)
    monkeypatch.setattr(torchrun_launch, "SWEEP_GRACE_S", 1)


@pytest.mark.usefixtures("short_graces")
def test_cancel_and_timeout_end_the_job_on_every_node(openssh_server: LoopbackServer, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    # workers that ignore TERM outlive their agent (killed after its grace), out of its process group: the sweep
    # by the job's tag ends them
    payload = {"ready_dir": str(ready), "gate": str(tmp_path / "never"), "ignore_sigterm": True}
    cancelled_id, timed_out_id = new_launch_id(), new_launch_id()

    async def cancel_it() -> None:
        task = asyncio.ensure_future(
            launch_torchrun(two_node_job(openssh_server, payload), tmp_path / "c", launch_id=cancelled_id)
        )
        await wait_for_files(ready, 2, task)
        assert len(tagged_processes(cancelled_id)) >= 4  # two agents and two workers
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancel_it())
    assert wait_until_untagged(cancelled_id) == []

    job = two_node_job(openssh_server, {"gate": str(tmp_path / "never")}, timeout_s=8.0)
    with pytest.raises(LaunchError, match="did not finish within 8 s; it was stopped on every node"):
        asyncio.run(launch_torchrun(job, tmp_path / "t", launch_id=timed_out_id))
    assert wait_until_untagged(timed_out_id) == []
    assert not (tmp_path / "c" / "result.json").exists() and not (tmp_path / "t" / "result.json").exists()


def _processes(marker: str) -> list[str]:
    from remote_helpers import wait_until_gone

    return wait_until_gone(marker)
