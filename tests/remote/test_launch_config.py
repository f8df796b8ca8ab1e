"""`spike-replay.yaml`'s launch sections: torchrun across targets, Slurm clusters; errors name the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.launchers.launch_config import multinode_nodes, slurm_login
from axrl_spike_replay.remote.workspace_config import load_workspace_config

EXAMPLE = """\
targets:
  gpu-a: {ssh: "ssh root@10.0.0.5", python: /opt/venv/bin/python, setup: ["source /opt/env.sh"]}
  gpu-b: {ssh: "ssh root@10.0.0.6", python: /opt/venv/bin/python}
  hpc-login: {ssh: "ssh me@login.hpc", python: /shared/venv/bin/python, setup: ["module load slurm cuda"]}
multinode:
  pair:
    nodes: [gpu-a, gpu-b]
    nproc_per_node: 8
    addresses: {gpu-a: 10.0.0.5}
    rendezvous_timeout_s: 120
slurm:
  hpc:
    login: hpc-login
    partition: gpu
    account: rl-team
    time: "01:00:00"
    nodes: 2
    gpus_per_node: 8
    cpus_per_task: 64
    job_dir: /shared/scratch/me/axrl-jobs
    sbatch_args: ["--qos=high"]
    schedule_timeout_s: 600
  here:
    login: local
    setup: ["export SLURM_CONF=/etc/slurm/test.conf"]
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "spike-replay.yaml").write_text(text)
    return tmp_path


def test_the_documented_launch_sections_load_and_resolve_to_nodes(tmp_path: Path) -> None:
    config = load_workspace_config(write(tmp_path, EXAMPLE))
    assert config.launch is not None
    pair = config.launch.multinode["pair"]
    assert pair.nproc_per_node == 8 and pair.rendezvous_timeout_s == 120.0 and pair.rendezvous_port is None
    a, b = multinode_nodes(pair, config)
    assert (a.name, a.address, a.python, a.setup) == (
        "gpu-a",
        "10.0.0.5",
        "/opt/venv/bin/python",
        ("source /opt/env.sh",),
    )
    assert a.target is not None and a.target.ssh.host == "10.0.0.5" and b.address is None
    hpc = config.launch.slurm["hpc"]
    s = hpc.settings
    assert (s.partition, s.account, s.time, s.nodes, s.gpus_per_node, s.cpus_per_task) == (
        "gpu", "rl-team", "01:00:00", 2, 8, 64,
    )  # fmt: skip
    assert s.processes_per_node == 8 and s.sbatch_args == ("--qos=high",) and s.schedule_timeout_s == 600
    login = slurm_login(hpc, config)
    assert login.python == "/shared/venv/bin/python" and login.setup == ("module load slurm cuda",)
    here = slurm_login(config.launch.slurm["here"], config)
    assert here.target is None and here.python == sys.executable
    assert here.setup == ("export SLURM_CONF=/etc/slurm/test.conf",)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (("nodes: [gpu-a, gpu-b]", "nodes: [gpu-a, gpu-c]"), "multinode.pair.nodes: gpu-c not among the targets"),
        (("nproc_per_node: 8", "nproc_per_node: 0"), "multinode.pair.nproc_per_node must be a whole number"),
        (("    rendezvous_timeout_s: 120", "    rendevous_timeout_s: 120"), "unknown key(s) rendevous_timeout_s"),
        (("{gpu-a: 10.0.0.5}", "{gpu-a: '10.0.0.5; id'}"), "multinode.pair.addresses maps some of its nodes"),
        (("login: hpc-login", "login: nowhere"), "slurm.hpc.login must name a target, or be `local`"),
        (('time: "01:00:00"', "time: 1:30:00"), 'slurm.hpc.time: write it quoted, e.g. time: "01:30:00"'),
        (("partition: gpu", "partition: gpu;rm -rf"), "slurm.hpc: slurm `partition` 'gpu;rm -rf'"),
        (("gpus_per_node: 8", "gpus_per_node: eight"), "slurm `gpus_per_node` must be a whole number"),
        (("  here:\n", "  gpu-a:\n"), "slurm.gpu-a: the name is already a target"),
    ],
)
def test_bad_launch_sections_are_refused_naming_file_and_key(
    tmp_path: Path, change: tuple[str, str], says: str
) -> None:
    old, new = change
    assert old in EXAMPLE
    with pytest.raises(ConfigError) as caught:
        load_workspace_config(write(tmp_path, EXAMPLE.replace(old, new, 1)))
    assert str(caught.value).startswith(str(tmp_path / "spike-replay.yaml")) and says in str(caught.value)
