"""The replay as a Slurm job on the loopback cluster (Debian's slurmctld, slurmd, munged): `sbatch` → `srun` →
torchrun → the replay's own worker reproduces the spike as a local replay does; a cancelled replay is
`scancel`led with no process left; a job the scheduler never starts is cancelled with the partition named."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from launch_helpers import wait_until_untagged
from replay_launch_helpers import ONE_WORKER, SNAPSHOT, node_entry, replay_workers, wait_for_workers, write_workspace
from slurm_loopback import DOWN_PARTITION, SlurmCluster
from ssh_loopback import LoopbackServer

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.request.request_parts import MAX_REPEAT
from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import What, Where, replay_request
from axrl_spike_replay.investigation.runs import run_request

pytestmark = [pytest.mark.slow, ONE_WORKER]


@pytest.fixture
def cluster_ws(slurm_cluster: SlurmCluster, tmp_path: Path) -> Path:
    """A workspace whose `slurm:` entry `here` submits from this machine to the loopback cluster."""
    entry = {
        "login": "local",
        "python": sys.executable,
        "setup": list(slurm_cluster.setup),
        "partition": slurm_cluster.partition,
        "time": "5",
        "nproc_per_node": 2,
        "job_dir": str(tmp_path / "jobs"),
        "schedule_timeout_s": 60,
        "rendezvous_timeout_s": 30,
    }
    return write_workspace(tmp_path / "ws", {}, slurm={"here": entry})


def test_a_slurm_replay_runs_under_srun_and_reproduces(
    slurm_cluster: SlurmCluster, cluster_ws: Path, local_replay: ReplayResult
) -> None:
    local = local_replay
    result = run_request(replay_request(What(SNAPSHOT), Where(target="here"), workspace=cluster_ws))
    assert isinstance(result, ReplayResult)
    assert result.verdict == "reproduced" and result.fidelity == "full" and result.grad_norm == local.grad_norm
    node = result.node
    assert result.target == "here" and node is not None and node["launcher"] == "slurm"
    assert node["slurm_job_id"] and node["nodes"] == [slurm_cluster.node]
    assert sorted(p["rank"] for p in node["processes"]) == [0, 1]
    out = Path(result.output_dir)
    assert "srun" in (out / "launch" / "batch.sh").read_text()
    assert json.loads((out / "replay_result.json").read_text())["node"]["slurm_job_id"] == node["slurm_job_id"]
    assert slurm_cluster.jobs() == [] and wait_until_untagged(node["launch_id"]) == []


def test_a_cancelled_slurm_replay_is_scancelled_and_leaves_no_process(
    slurm_cluster: SlurmCluster, cluster_ws: Path
) -> None:
    cancel = threading.Event()
    ended: list = []
    request = replay_request(
        What(SNAPSHOT, repeat=MAX_REPEAT), Where(target="here"), workspace=cluster_ws, cancel=cancel
    )

    def work() -> None:
        try:
            ended.append(run_request(request))
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    launch_id = wait_for_workers(2, lambda: bool(ended), seconds=180)
    assert len(slurm_cluster.jobs()) == 1
    cancel.set()
    thread.join(120)
    assert ended and isinstance(ended[0], AxrlError) and "cancelled" in str(ended[0]), ended
    assert slurm_cluster.jobs() == [] and wait_until_untagged(launch_id, 30.0) == []
    results = [json.loads(p.read_text()) for p in (cluster_ws / "tmp").rglob("replay_result.json")]
    assert [r["verdict"] for r in results] == ["failed"] and results[0]["grad_norm"] is None


def test_a_job_never_scheduled_is_cancelled_naming_the_partition(slurm_cluster: SlurmCluster, cluster_ws: Path) -> None:
    where = Where(target="here", slurm={"partition": DOWN_PARTITION, "schedule_timeout_s": 4})
    with pytest.raises(AxrlError) as caught:
        run_request(replay_request(What(SNAPSHOT), where, workspace=cluster_ws))
    message = str(caught.value)
    assert DOWN_PARTITION in message and "Traceback" not in message
    assert slurm_cluster.jobs() == [] and replay_workers() == {}
    result = json.loads(next((cluster_ws / "tmp").rglob("replay_result.json")).read_text())
    assert result["verdict"] == "failed" and result["grad_norm"] is None


def test_a_login_node_over_ssh_with_the_settings_given_as_arguments(
    slurm_cluster: SlurmCluster, openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    ws = write_workspace(tmp_path / "ws", {"login": node_entry(openssh_server, setup=slurm_cluster.setup)})
    slurm = {
        "partition": slurm_cluster.partition,
        "nproc_per_node": 2,
        "time": "5",
        "job_dir": str(tmp_path / "jobs"),
        "schedule_timeout_s": 60,
    }
    result = run_request(replay_request(What(SNAPSHOT), Where(target="login", slurm=slurm), workspace=ws))
    assert isinstance(result, ReplayResult) and result.verdict == "reproduced" and result.world_size_used == 2
    assert result.target == "slurm@login" and result.node is not None and result.node["launcher"] == "slurm"
    command = (Path(result.output_dir) / "command.txt").read_text()
    assert "--target login --slurm" in command and f"--partition {slurm_cluster.partition}" in command
    assert slurm_cluster.jobs() == [] and wait_until_untagged(result.node["launch_id"]) == []
