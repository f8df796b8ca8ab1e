"""Launch command lines run for real by a shell (words arrive literally), Slurm's output parsed, failures worded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.launchers.launch_job import (
    LaunchError,
    WorkerEntry,
    check_node_ready,
    new_launch_id,
    request_document,
)
from axrl_spike_replay.remote.launchers.slurm_command import (
    SlurmSettings,
    batch_script,
    failed_node,
    job_dir_script,
    parse_job_id,
    parse_sacct,
    parse_scontrol,
    parse_squeue,
    sbatch_argv,
)
from axrl_spike_replay.remote.launchers.torchrun_command import (
    Rendezvous,
    agent_script,
    parse_sweep,
    rendezvous_failure,
    sweep_script,
    torchrun_argv,
)
from axrl_spike_replay.remote.launchers.torchrun_failure import AgentState, explain_failure, timeout_error
from axrl_spike_replay.remote.nodes.node_probe import NodeReport

NASTY = "we ird 'q' \"d\" $(touch PWNED) `touch PWNED2` ; & | $HOME *"
ECHO_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"


def test_one_node_runs_standalone_and_several_share_one_c10d_rendezvous() -> None:
    worker = WorkerEntry(module="axrl_spike_replay.processes.launch_worker", args=("--x", "1"))
    alone = torchrun_argv("py", worker, "/r.json", nproc_per_node=4)
    assert alone == [
        *("py", "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4", "--standalone"),
        *("--max-restarts", "0", "-m", "axrl_spike_replay.processes.launch_worker", "/r.json", "--x", "1"),
    ]
    rdzv = Rendezvous("10.0.0.5", 29400, "axrl-0123456789ab", 30.0)
    words = torchrun_argv("py", worker, "/r.json", nproc_per_node=8, nnodes=2, rendezvous=rdzv, is_host=True)
    joined = " ".join(words)
    assert "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.5:29400" in joined
    assert "--rdzv-id axrl-0123456789ab --rdzv-conf join_timeout=30,read_timeout=30,is_host=1" in joined
    assert "--standalone" not in words and "--node-rank" not in words  # c10d assigns the group ranks
    v6 = Rendezvous("fd00::5", 29400, "axrl-0123456789ab", 30.0)
    assert "[fd00::5]:29400" in torchrun_argv("py", worker, "/r", nproc_per_node=1, nnodes=2, rendezvous=v6)
    with_addr = torchrun_argv("py", worker, "/r", nproc_per_node=1, nnodes=2, rendezvous=rdzv, local_addr="10.0.0.6")
    assert "--local-addr 10.0.0.6" in " ".join(with_addr)
    with pytest.raises(ValueError, match="several nodes need a rendezvous"):
        torchrun_argv("py", worker, "/r", nproc_per_node=1, nnodes=2)
    with pytest.raises(ValueError, match="not a host name"):
        Rendezvous("a b; rm -rf /", 1, "axrl-0123456789ab", 1.0)
    with pytest.raises(ValueError, match="dotted Python module"):
        WorkerEntry(module="os; rm")


def test_the_agent_script_passes_every_word_literally_and_tags_the_job(tmp_path: Path) -> None:
    launch_id = new_launch_id()
    argv = [sys.executable, "-c", ECHO_ARGV + "; import os; print(os.environ['AXRL_LAUNCH_ID'], os.environ['X'])"]
    script = agent_script([*argv, NASTY], launch_id, setup=["export Y=1"], env={"X": NASTY})
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True)
    lines = got.stdout.splitlines()
    assert json.loads(lines[0]) == [NASTY] and lines[1] == f"{launch_id} {NASTY}"
    assert got.stderr.startswith("@@axrl-agent started ")  # the launcher's sign that setup lines are done
    assert not list(tmp_path.iterdir())  # nothing touched


def test_the_sweep_ends_tagged_processes_even_those_ignoring_term() -> None:
    launch_id = new_launch_id()
    env = {**os.environ, "AXRL_LAUNCH_ID": launch_id}
    stubborn = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; sleep 60 & sleep 60; wait"], env=env, start_new_session=True
    )
    time.sleep(0.3)  # both children started
    got = subprocess.run(sweep_script(launch_id, grace_s=1), shell=True, capture_output=True, text=True, check=True)
    assert parse_sweep(got.stdout) == (3, 0)  # the shell (TERM ignored: KILLed after 1 s) and its two sleeps
    assert stubborn.wait(5) == -9
    again = subprocess.run(sweep_script(launch_id, grace_s=1), shell=True, capture_output=True, text=True, check=True)
    assert parse_sweep(again.stdout) == (0, 0)
    with pytest.raises(ValueError, match="not one this tool made"):
        sweep_script("axrl-*")  # never a pattern that could match other jobs


def test_the_batch_script_starts_srun_with_the_first_node_as_rendezvous(tmp_path: Path) -> None:
    """Run under bash with stand-ins for scontrol and srun: the words srun gets are exactly torchrun's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-017\\ngpu-018\\n'\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\nexec {sys.executable} -c '{ECHO_ARGV}' \"$@\"\n")
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    settings = SlurmSettings(partition="gpu", nodes=2, gpus_per_node=8, rendezvous_timeout_s=60)
    request = f"/shared/{NASTY}/request.json"
    launch_id = new_launch_id()
    script = batch_script(
        settings, sys.executable, WorkerEntry(script=f"/w/{NASTY}.py"), request, launch_id, setup=["true"]
    )
    assert script.startswith("#!/bin/bash\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[017-018]"}
    env["SLURM_JOB_NUM_NODES"] = "2"
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    words = json.loads(got.stdout)
    endpoint = words[words.index("--rdzv-endpoint") + 1]
    assert endpoint.startswith("gpu-017:") and endpoint.split(":")[1].isdigit()
    assert words[:3] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert words[words.index("--nnodes") + 1] == "2" and words[words.index("--nproc-per-node") + 1] == "8"
    assert words[-2:] == [f"/w/{NASTY}.py", request] and words[words.index("--rdzv-id") + 1] == launch_id
    assert f"@@axrl-slurm rendezvous {endpoint} on gpu-[017-018]" in got.stderr
    assert not list(tmp_path.glob("PWNED*"))


def test_sbatch_asks_for_what_the_settings_say_and_the_job_dir_lands_under_home(tmp_path: Path) -> None:
    settings = SlurmSettings(
        partition="gpu", account="rl", time="01:30:00", nodes=4, gpus_per_node=8, cpus_per_task=32,
        sbatch_args=("--qos=high",),
    )  # fmt: skip
    argv = sbatch_argv(settings, "/shared/j d/axrl-slurm-x", "axrl-0123456789ab")
    assert argv[:3] == ["sbatch", "--parsable", "--job-name=axrl-0123456789ab"]
    for word in ("--nodes=4", "--ntasks-per-node=1", "--partition=gpu", "--account=rl", "--time=01:30:00"):
        assert word in argv
    assert "--gpus-per-node=8" in argv and "--cpus-per-task=32" in argv and "--qos=high" in argv
    assert "--output=/shared/j d/axrl-slurm-x/slurm-%j.out" in argv and argv[-1] == "/shared/j d/axrl-slurm-x/batch.sh"
    home = tmp_path / "home dir"
    got = subprocess.run(
        ["sh", "-c", job_dir_script("~/jobs $(x)")], env={**os.environ, "HOME": str(home)}, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    made = Path(got.stdout.strip())
    assert made.parent == home / "jobs $(x)" and made.name.startswith("axrl-slurm-") and made.is_dir()


@pytest.mark.parametrize(
    ("knobs", "says"),
    [
        ({"partition": "gpu;rm"}, "slurm `partition` 'gpu;rm'"),
        ({"time": "1 hour"}, "slurm `time` '1 hour': give minutes"),
        ({"nodes": 0}, "slurm `nodes` must be a whole number of at least 1"),
        ({"job_dir": "/x/%j"}, "without % or line breaks"),
        ({"sbatch_args": ("script.sh",)}, "'script.sh' is not a long sbatch option"),
        ({"schedule_timeout_s": 0}, "`schedule_timeout_s` must be a positive number"),
    ],
)
def test_bad_slurm_settings_are_refused_by_name(knobs: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        SlurmSettings(**knobs)


def test_slurm_answers_are_read_as_slurm_prints_them() -> None:
    assert parse_job_id("4711\n") == "4711" and parse_job_id("4711;cluster-a\n") == "4711"
    assert parse_job_id("sbatch: error: Batch job submission failed\n") is None
    pending = parse_squeue("PENDING|PartitionDown|\n")
    assert pending is not None and pending.pending and not pending.hopeless and pending.reason == "PartitionDown"
    stuck = parse_squeue("PENDING|PartitionConfig|\n")
    assert stuck is not None and stuck.hopeless
    running = parse_squeue("RUNNING|None|gpu-[017-018]\n")
    assert running is not None and running.running and running.nodes == "gpu-[017-018]"
    assert parse_squeue("") is None
    line = (
        "JobId=12 JobName=axrl-0123456789ab UserId=root(0) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
        "ExitCode=1:0 RunTime=00:00:04 NodeList=vm BatchHost=vm NumNodes=1"
    )
    failed = parse_scontrol(line)
    assert failed is not None and (failed.state, failed.exit_code, failed.nodes) == ("FAILED", "1:0", "vm")
    assert not failed.succeeded and parse_scontrol("slurm_load_jobs error: Invalid job id specified") is None
    done = parse_sacct("COMPLETED|0:0|gpu-[1-2]|None\n")
    assert done is not None and done.succeeded and done.nodes == "gpu-[1-2]"
    cancelled = parse_sacct("CANCELLED by 0|0:15|vm|None\n")
    assert cancelled is not None and cancelled.state == "CANCELLED" and not cancelled.succeeded
    output = "...\nsrun: error: gpu-018: task 1: Exited with exit code 3\nsrun: Terminating StepId=12.0\n"
    assert failed_node(output) == "gpu-018" and failed_node("all fine") is None


def test_a_rendezvous_failure_names_the_node_at_fault() -> None:
    rdzv = Rendezvous("10.0.0.5", 29400, "axrl-0123456789ab", 30.0)
    timed_out = AgentState("a", True, True, False, "exit status 1", "timeout", "RendezvousTimeoutError")
    never = explain_failure([timed_out, AgentState("b", False, False, False)], rdzv)
    assert never.node == "b" and "node(s) 'b' never started a torchrun agent" in str(never)
    assert "10.0.0.5:29400 (id axrl-0123456789ab) did not complete within 30 s" in str(never)
    unreachable = AgentState("b", True, True, False, "exit status 1", "connection", "RendezvousConnectionError")
    blocked = explain_failure([timed_out, unreachable], rdzv)
    assert blocked.node == "b" and "node(s) 'b' could not reach the rendezvous store at 10.0.0.5:29400" in str(blocked)
    crashed = AgentState("b", True, True, False, "exit status 1", None, "exitcode : 3")
    plain = explain_failure([AgentState("a", True, False, False), crashed], None)
    assert (
        plain.node == "b" and str(plain).startswith("node 'b' failed: exit status 1.") and "exitcode : 3" in str(plain)
    )
    late = timeout_error([AgentState("a", True, False, False), AgentState("b", False, False, False)], "axrl-x", 9)
    assert late.node == "b" and "did not finish within 9 s; node(s) 'b' never started a torchrun agent" in str(late)
    assert rendezvous_failure("...RendezvousTimeoutError\n") == "timeout" and rendezvous_failure("ok") is None


def test_a_node_that_cannot_run_the_job_is_told_what_to_do() -> None:
    bare = NodeReport(target="n", hostname="gpu-3", python_version="3.11.2", notes=[])
    with pytest.raises(LaunchError) as caught:
        check_node_ready(bare, "n", python="/usr/bin/python3")
    message = str(caught.value)
    assert caught.value.node == "n" and message.startswith("node 'n' (gpu-3) cannot run the job: ")
    assert "torch is not importable with /usr/bin/python3" in message and "--install" in message
    no_python = NodeReport(target="n", notes=["/opt/py did not run: sh: /opt/py: not found"])
    with pytest.raises(LaunchError, match=r"/opt/py did not run there .*not found.*set `python:`"):
        check_node_ready(no_python, "n", python="/opt/py")
    ready = NodeReport(target="n", python_version="3.11", torch_version="2.13", package_importable=True)
    check_node_ready(ready, "n", python="py")  # no error
    assert request_document("axrl-0123456789ab", "/t/result.json", {"k": 1})["payload"] == {"k": 1}


def test_the_launch_probe_finds_torch_without_importing_it() -> None:
    import asyncio

    from axrl_spike_replay.remote.nodes.node_probe import probe
    from axrl_spike_replay.remote.transport.local_session import LocalSession

    light = asyncio.run(probe(LocalSession(), python=sys.executable, import_torch=False))
    assert light.torch_version is not None and light.package_importable
    assert light.cuda_available is None  # torch was only looked up: nothing asked of CUDA
    if Path("/usr/bin/python3").exists():
        bare = asyncio.run(probe(LocalSession(), python="/usr/bin/python3", import_torch=False))
        assert bare.torch_version is None and any("No module named 'torch'" in note for note in bare.notes)
