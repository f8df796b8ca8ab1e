"""`--dry-run` and `plan` print the launcher's dry run: what would start where, with nothing connected or started.
The workspace names nodes no one can reach, so anything that tried to connect would fail."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from replay_launch_helpers import SNAPSHOT

from axrl_spike_replay.cli import main

WORKSPACE = """\
targets:
  gpu-a: {ssh: "ssh root@192.0.2.5", python: /opt/venv/bin/python, setup: ["source /opt/env.sh"]}
  gpu-b: {ssh: "ssh root@192.0.2.6", python: /opt/venv/bin/python}
multinode:
  pair: {nodes: [gpu-a, gpu-b], nproc_per_node: 1, addresses: {gpu-a: 192.0.2.5}, rendezvous_port: 29411}
slurm:
  hpc: {login: gpu-a, partition: gpu, nodes: 2, gpus_per_node: 1, job_dir: /shared/jobs}
"""


def _dry(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> dict:
    (tmp_path / "spike-replay.yaml").write_text(WORKSPACE)
    assert main([*argv, "--workspace", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    made = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "tmp").rglob("*"))
    # no run dir: nothing ran (a plan here keeps this machine's measured speeds, `replay.plans.node_speeds`)
    assert made in ([], ["tmp/spike-replay", "tmp/spike-replay/node-speeds.json"]), made
    return doc


def test_dry_run_of_a_multinode_replay_is_each_nodes_torchrun_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    doc = _dry(capsys, tmp_path, "replay", str(SNAPSHOT), "--target", "pair", "--dry-run")
    assert (doc["launcher"], doc["processes"]) == ("torchrun", 2)
    first, second = (command.splitlines() for command in doc["commands"])
    assert first[:2] == ["# node gpu-a", "source /opt/env.sh"] and second[0] == "# node gpu-b"
    for words, host in ((shlex.split(first[2]), "1"), (shlex.split(second[1]), "0")):
        assert words[:3] == ["/opt/venv/bin/python", "-m", "torch.distributed.run"]
        assert (
            words[words.index("--rdzv-endpoint") + 1] == "192.0.2.5:29411" and words[words.index("--nnodes") + 1] == "2"
        )
        assert f"is_host={host}" in words[words.index("--rdzv-conf") + 1]
        assert words[-3:] == ["-m", "axrl_spike_replay.replay.jobs.torchrun_worker", "TEMP/request.json"]


def test_dry_run_of_a_slurm_sweep_is_its_sbatch_line_and_batch_script(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["sweep", str(SNAPSHOT), "--target", "hpc", "--mitigation", "advantage_clip=1", "--dry-run"]
    doc = _dry(capsys, tmp_path, *argv)
    assert (doc["launcher"], doc["processes"]) == ("slurm", 2)
    submit, script = doc["commands"]
    words = shlex.split(submit.splitlines()[1])
    assert words[0] == "sbatch" and "--partition=gpu" in words and "--nodes=2" in words
    assert words[-1] == "/shared/jobs/JOB_DIR/batch.sh"
    assert (
        "source /opt/env.sh" in script
        and "srun " in script
        and "/opt/venv/bin/python -m torch.distributed.run" in script
    )


def test_dry_run_here_and_the_plan_name_the_rank_processes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc = _dry(capsys, tmp_path, "replay", str(SNAPSHOT), "--nproc", "2", "--dry-run")
    assert (doc["launcher"], doc["processes"]) == ("spawn", 2)
    plan = _dry(capsys, tmp_path, "plan", str(SNAPSHOT), "--nproc", "2")
    assert plan["launch"] == doc  # the plan's `would launch:` is the dry run
    one = _dry(capsys, tmp_path, "replay", str(SNAPSHOT), "--target", "gpu-a", "--dry-run")
    assert one["launcher"] is None and "gpu-a runs the replay itself" in one["text"]
