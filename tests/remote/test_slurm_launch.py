"""Slurm on loopback: a one-node cluster (Debian's slurmctld, slurmd, munged) runs the job as `sbatch` → `srun` →
torchrun → a real gloo all-reduce; cancel is `scancel`, a job never scheduled is cancelled with squeue's reason."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from launch_helpers import WORKER, ssh_node, tagged_processes, wait_for_files, wait_until_untagged
from slurm_loopback import DOWN_PARTITION, SlurmCluster
from ssh_loopback import LoopbackServer

from axrl_spike_replay.remote.launchers.launch_job import LaunchError, LaunchNode, new_launch_id
from axrl_spike_replay.remote.launchers.slurm_command import SlurmSettings
from axrl_spike_replay.remote.launchers.slurm_launch import SlurmJob, launch_slurm

pytestmark = pytest.mark.slow


def settings(cluster: SlurmCluster, job_dir: Path, **knobs: object) -> SlurmSettings:
    values: dict = {
        "partition": cluster.partition,
        "nodes": 1,
        "nproc_per_node": 2,
        "time": "5",
        "job_dir": str(job_dir),
        "schedule_timeout_s": 60.0,
        "rendezvous_timeout_s": 30.0,
        "poll_s": 0.3,
    }
    return SlurmSettings(**{**values, **knobs})


def here(cluster: SlurmCluster, *setup: str) -> LaunchNode:
    """This machine as the login node; its setup line points the Slurm commands at the loopback cluster."""
    return LaunchNode("login-here", python=sys.executable, setup=(*cluster.setup, *setup))


def test_sbatch_from_a_login_node_over_ssh_runs_torchrun_under_srun(
    slurm_cluster: SlurmCluster, openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    login = ssh_node("login", openssh_server, *slurm_cluster.setup)
    job = SlurmJob(login, WORKER, settings(slurm_cluster, tmp_path / "jobs"), timeout_s=120.0)
    launch_id = new_launch_id()
    said: list[str] = []
    outcome = asyncio.run(launch_slurm(job, tmp_path / "out", launch_id=launch_id, progress=said.append))
    result = outcome.result
    assert result["sum"] == 3.0 and result["world_size"] == 2
    assert {p["slurm_job_id"] for p in result["processes"]} == {outcome.job_id}  # the workers ran inside the job
    assert {p["launch_tag"] for p in result["processes"]} == {launch_id}
    assert outcome.launcher == "slurm" and outcome.nodes == (slurm_cluster.node,)  # as scontrol expands the list
    assert json.loads(outcome.result_path.read_text()) == result
    output = outcome.logs["slurm"].read_text()
    assert f"@@axrl-slurm rendezvous {slurm_cluster.node}:" in output  # the allocation's first node hosts it
    batch = (tmp_path / "out" / "batch.sh").read_text()
    assert 'exec srun --nodes="$SLURM_JOB_NUM_NODES"' in batch and "--rdzv-backend c10d" in batch
    assert any(f"Slurm job {outcome.job_id} running on {slurm_cluster.node}" in line for line in said)
    assert slurm_cluster.jobs() == [] and wait_until_untagged(launch_id) == []
    assert list((tmp_path / "jobs").iterdir()) == []  # the job dir was removed


def test_a_cancelled_slurm_job_is_scancelled_and_leaves_no_process(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    payload = {"ready_dir": str(ready), "gate": str(tmp_path / "never"), "ignore_sigterm": True}
    job = SlurmJob(here(slurm_cluster), WORKER, settings(slurm_cluster, tmp_path / "jobs"), payload=payload)
    launch_id = new_launch_id()

    async def story() -> None:
        task = asyncio.ensure_future(launch_slurm(job, tmp_path / "out", launch_id=launch_id))
        await wait_for_files(ready, 2, task)
        assert len(slurm_cluster.jobs()) == 1 and len(tagged_processes(launch_id)) >= 3  # srun, agent, 2 workers
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(story())
    assert slurm_cluster.jobs() == []
    assert wait_until_untagged(launch_id) == []  # workers that shrug off TERM too: Slurm KILLs after KillWait
    assert not (tmp_path / "out" / "result.json").exists()
    assert list((tmp_path / "jobs").iterdir()) == []
    assert list((tmp_path / "out").glob("slurm-*.out"))  # the partial output was kept


def test_a_slurm_job_past_its_timeout_is_cancelled(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    payload = {"gate": str(tmp_path / "never")}
    job = SlurmJob(
        here(slurm_cluster), WORKER, settings(slurm_cluster, tmp_path / "jobs"), payload=payload, timeout_s=3
    )
    launch_id = new_launch_id()
    with pytest.raises(LaunchError, match=r"did not finish within 3 s; it was cancelled \(scancel\) on every node"):
        asyncio.run(launch_slurm(job, tmp_path / "out", launch_id=launch_id))
    assert slurm_cluster.jobs() == [] and wait_until_untagged(launch_id) == []
    assert not (tmp_path / "out" / "result.json").exists()


def test_a_job_never_scheduled_is_cancelled_naming_partition_and_reason(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job = SlurmJob(
        here(slurm_cluster),
        WORKER,
        settings(slurm_cluster, tmp_path / "jobs", partition=DOWN_PARTITION, schedule_timeout_s=2.0),
    )
    with pytest.raises(LaunchError) as caught:
        asyncio.run(launch_slurm(job, tmp_path / "out"))
    message = str(caught.value)
    assert f"was not scheduled within 2 s on partition {DOWN_PARTITION}" in message
    assert "reason PartitionDown" in message and "It was cancelled" in message
    assert slurm_cluster.jobs() == []


@pytest.mark.parametrize("ask", ["more CPUs than the node has", "a partition that does not exist"])
def test_slurm_refusing_the_request_is_a_clear_error(slurm_cluster: SlurmCluster, tmp_path: Path, ask: str) -> None:
    knobs: dict = {"cpus_per_task": slurm_cluster.cpus + 1} if "CPUs" in ask else {"partition": "no-such-partition"}
    job = SlurmJob(here(slurm_cluster), WORKER, settings(slurm_cluster, tmp_path / "jobs", **knobs))
    with pytest.raises(LaunchError) as caught:
        asyncio.run(launch_slurm(job, tmp_path / "out"))
    message = str(caught.value)
    if "CPUs" in ask:  # Slurm queues it (EnforcePartLimits=NO, its default), pending for a reason that never clears
        assert message.startswith("Slurm job ") and "cannot be scheduled on partition loop" in message
        assert f"{slurm_cluster.cpus + 1} CPU(s) per node" in message and "reason PartitionConfig" in message
        assert "It was cancelled" in message
    else:  # sbatch refuses it at once
        assert message.startswith("Slurm refused the job (partition no-such-partition") and "'login-here'" in message
        assert "invalid partition" in message.lower()
    assert slurm_cluster.jobs() == [] and list((tmp_path / "jobs").iterdir()) == []


def test_a_job_whose_worker_crashes_names_the_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = SlurmJob(here(slurm_cluster, "export AXRL_TEST_CRASH=1"), WORKER, settings(slurm_cluster, tmp_path / "jobs"))
    launch_id = new_launch_id()
    with pytest.raises(LaunchError) as caught:
        asyncio.run(launch_slurm(job, tmp_path / "out", launch_id=launch_id))
    assert caught.value.node == slurm_cluster.node
    assert f"failed on node {slurm_cluster.node!r}: FAILED" in str(caught.value)
    assert not (tmp_path / "out" / "result.json").exists()
    assert slurm_cluster.jobs() == [] and wait_until_untagged(launch_id) == []


def test_a_login_node_without_slurm_commands_is_refused(tmp_path: Path) -> None:
    login = LaunchNode("laptop", python=sys.executable, setup=("export PATH=/nonexistent",))
    with pytest.raises(LaunchError, match=r"login node 'laptop': sbatch, squeue, scancel, scontrol not found"):
        asyncio.run(launch_slurm(SlurmJob(login, WORKER), tmp_path / "out"))
