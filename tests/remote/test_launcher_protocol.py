"""The launcher protocol on the real launchers: each dry run is the command a launch then runs (torchrun's
command.txt, Slurm's sbatch line and batch script, the spawn launcher's processes); a submitted launch reports its
state, its logs and, cancelled, stops every process; the spawn launcher's outcomes are `run_job`'s."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import WORKER, wait_for_files, wait_until_untagged
from replay_launch_helpers import FIXTURE
from slurm_loopback import SlurmCluster

from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.remote.launchers.launch_job import LaunchNode, new_launch_id
from axrl_spike_replay.remote.launchers.launcher import Launch, LaunchStatus
from axrl_spike_replay.remote.launchers.slurm_command import SlurmSettings
from axrl_spike_replay.remote.launchers.slurm_launch import SlurmJob, SlurmLauncher
from axrl_spike_replay.remote.launchers.spawn_launch import SpawnLauncher
from axrl_spike_replay.remote.launchers.torchrun_launch import TorchrunJob, TorchrunLauncher
from axrl_spike_replay.replay.compute.clean_gradient import spike_bar
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.jobs.job_runner import run_job
from axrl_spike_replay.replay.jobs.torchrun_worker import RESULT_KIND
from axrl_spike_replay.replay.plans.layout_plan import plan_layout
from axrl_spike_replay.replay.reading.inputs import load_inputs

SNAPSHOT = FIXTURE / "checkpoints" / "spike_snapshots" / "iter_0000020"


def _job(nproc: int) -> WorkerJob:
    inputs = load_inputs(SNAPSHOT, SNAPSHOT, False)
    applied = [apply_config({}, inputs.loss, inputs.routing)]
    applied.append(apply_config(parse_config({"advantage_clip": 0.5}), inputs.loss, inputs.routing))
    return WorkerJob(
        replay_dir=str(SNAPSHOT),
        model=inputs.model,
        configs=tuple(applied),
        world_size=inputs.world_size,
        assignment=plan_layout(inputs.world_size, nproc).assignment,
        counts=inputs.counts,
        spike_bar=spike_bar(inputs.metadata.median_norm, 5.0),
    )


def _figures(outcome: ConfigOutcome) -> dict:
    doc = dataclasses.asdict(outcome)
    doc.pop("timings")
    return doc


def _rank_processes() -> list[int]:
    """Live rank processes of this test process: forked by its process server, or spawned as its children."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
            cmdline = (entry / "cmdline").read_bytes() if status else b""
        except OSError:
            continue
        if not status or "\nState:\tZ" in status or b"multiprocessing" not in cmdline:
            continue
        parent = int(next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1])
        if parent == me and b"multiprocessing.spawn" not in cmdline:
            continue  # the process server or the resource tracker, not a rank
        if parent == me or _parent_of(parent) == me:
            found.append(int(entry.name))
    return found


def _parent_of(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1])


async def _until(launch: Launch, *states: str, seconds: float = 120.0) -> LaunchStatus:
    """The launch's status once it is in one of `states` (fails when it ends in another first)."""
    for _ in range(int(seconds / 0.05)):
        status = launch.status()
        if status.state in states:
            return status
        assert not status.ended, f"ended {status.state}: {status.detail}"
        await asyncio.sleep(0.05)
    raise AssertionError(f"still {launch.status().state} after {seconds} s")


def test_the_spawn_launcher_gives_run_jobs_outcomes_with_a_log_and_a_result_file(tmp_path: Path) -> None:
    job = _job(1)  # one process replaying both saved ranks: it runs in this process
    said: list[str] = []

    async def launched() -> tuple[LaunchStatus, list[ConfigOutcome], Launch]:
        launch = SpawnLauncher().submit(job, tmp_path / "out", progress=said.append)
        outcome = await launch.wait()
        assert outcome.launcher == "spawn" and outcome.nodes == ("local",) and outcome.result["kind"] == RESULT_KIND
        return launch.status(), [ConfigOutcome(**o) for o in outcome.result["outcomes"]], launch

    status, outcomes, launch = asyncio.run(launched())
    direct = run_job(job)
    assert [_figures(o) for o in outcomes] == [_figures(o) for o in direct]
    assert status.state == "succeeded" and status.launcher == "spawn"
    assert said and launch.logs()["spawn"].read_text().splitlines() == said  # every progress line, in order
    dry = SpawnLauncher().dry_run(job)
    assert (dry.launcher, dry.processes) == ("spawn", 1) and "in this process" in dry.where
    assert dry.commands == ("# process 0: device cpu; saved rank(s) 0, 1",)


@pytest.mark.processes
def test_a_cancelled_spawn_launch_leaves_no_rank_process(tmp_path: Path) -> None:
    job = _job(2)
    dry = SpawnLauncher().dry_run(job)
    assert dry.processes == 2 and [c.split(";")[1] for c in dry.commands] == [" saved rank(s) 0", " saved rank(s) 1"]

    # the session's warm pools keep rank processes of their own, forked by the same process server: count only
    # the ones this launch starts
    before = set(_rank_processes())

    def launched() -> set[int]:
        return set(_rank_processes()) - before

    async def cancel_it() -> LaunchStatus:
        launch = SpawnLauncher().submit(job, tmp_path / "out")
        await _until(launch, "running")
        for _ in range(1200):  # until both rank processes run
            if len(launched()) >= 2 or launch.status().ended:
                break
            await asyncio.sleep(0.05)
        assert len(launched()) >= 2, launch.status()
        launch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await launch.wait()
        return launch.status()

    status = asyncio.run(cancel_it())
    assert status.state == "cancelled"
    assert launched() == set()
    assert not (tmp_path / "out" / "result.json").exists()


@pytest.mark.processes
def test_torchrun_runs_its_dry_run_and_a_cancelled_launch_ends_every_process(tmp_path: Path) -> None:
    node = LaunchNode("here", setup=("export AXRL_DRY_RUN_CHECK=1",))
    job = TorchrunJob(nodes=(node,), worker=WORKER, nproc_per_node=2, timeout_s=120.0)
    dry = TorchrunLauncher().dry_run(job)
    assert (dry.launcher, dry.processes) == ("torchrun", 2)
    launch_id = new_launch_id()
    outcome = asyncio.run(TorchrunLauncher().launch(job, tmp_path / "out", launch_id=launch_id))
    assert outcome.result["world_size"] == 2 and outcome.launcher == "torchrun"
    ran = (tmp_path / "out" / "command.txt").read_text()
    temp = re.search(r"(\S+)/request\.json", ran)
    assert temp is not None
    dry_command = dry.commands[0].replace("TEMP/", f"{temp.group(1)}/")
    assert dry_command.splitlines()[:1] + dry_command.splitlines()[2:] == ran.splitlines()  # less the setup line
    assert dry_command.splitlines()[1] == "export AXRL_DRY_RUN_CHECK=1"

    ready = tmp_path / "ready"
    ready.mkdir()
    gated = dataclasses.replace(job, payload={"ready_dir": str(ready), "gate": str(tmp_path / "never")})
    cancelled = new_launch_id()

    async def cancel_it() -> tuple[LaunchStatus, dict[str, Path]]:
        launch = TorchrunLauncher().submit(gated, tmp_path / "c", launch_id=cancelled)
        assert launch.launch_id == cancelled
        await wait_for_files(ready, 2, asyncio.ensure_future(launch.wait()))
        running = launch.status()
        assert running.state == "running", running
        logs = launch.logs()
        launch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await launch.wait()
        return launch.status(), logs

    status, logs = asyncio.run(cancel_it())
    assert status.state == "cancelled" and set(logs) == {"node0-here.stdout", "node0-here.stderr"}
    assert wait_until_untagged(cancelled) == []


@pytest.mark.slurm
def test_slurm_runs_its_dry_runs_sbatch_line_and_batch_script(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    settings = SlurmSettings(
        partition=slurm_cluster.partition, nodes=1, nproc_per_node=2, time="5", job_dir=str(tmp_path / "jobs"),
        schedule_timeout_s=60.0, rendezvous_timeout_s=30.0, poll_s=0.3,
    )  # fmt: skip
    login = LaunchNode("login-here", python=sys.executable, setup=tuple(slurm_cluster.setup))
    job = SlurmJob(login, WORKER, settings)
    dry = SlurmLauncher().dry_run(job)
    example = re.search(r"axrl-[0-9a-f]{12}", dry.commands[0])
    assert example is not None and dry.processes == 2
    script = dry.commands[1].split("\n", 1)[1]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0

    async def follow() -> tuple[LaunchStatus, str]:
        launch = SlurmLauncher().submit(job, tmp_path / "out")
        status = await _until(launch, "pending", "running")
        outcome = await launch.wait()
        assert outcome.result["world_size"] == 2 and outcome.job_id == status.job_id is not None
        return launch.status(), launch.launch_id

    status, launch_id = asyncio.run(follow())
    assert status.state == "succeeded"
    ran = (tmp_path / "out" / "command.txt").read_text()
    job_dir = re.search(r"--chdir=(\S+)", ran)
    assert job_dir is not None

    def real(text: str) -> str:
        return text.replace(example.group(0), launch_id).replace(f"{settings.job_dir}/JOB_DIR", job_dir.group(1))

    assert real(dry.commands[0]) + "\n" == ran
    assert real(script) == (tmp_path / "out" / "batch.sh").read_text()
