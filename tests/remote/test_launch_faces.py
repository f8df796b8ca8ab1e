"""Where a replay's processes run, as the user says it: `--target` repeated for several nodes, `--slurm` and the
allocation's settings on the CLI, `targets` and `slurm` in the MCP tools; combinations that cannot work are refused
by name before anything connects."""

from __future__ import annotations

from pathlib import Path

import pytest
from replay_launch_helpers import SNAPSHOT

from axrl_spike_replay.cli import build_parser
from axrl_spike_replay.cli.remote_options import where_from_args
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import What, Where, launched, replay_request


def _where(*argv: str) -> Where:
    return where_from_args(build_parser().parse_args(["replay", str(SNAPSHOT), *argv]))


def test_the_cli_says_several_nodes_by_repeating_target_and_slurm_by_its_options() -> None:
    one = _where("--target", "gpu-a")
    assert one.target == "gpu-a" and one.targets == () and one.slurm is None
    two = _where("--target", "gpu-a", "--target", "root@10.0.0.6:2222")
    assert two.target == "local" and two.targets == ("gpu-a", "root@10.0.0.6:2222")
    hpc = _where("--target", "hpc", "--partition", "gpu", "--nodes", "2", "--gpus-per-node", "8", "--time", "01:00:00")
    assert hpc.target == "hpc" and hpc.slurm == {"partition": "gpu", "nodes": 2, "gpus_per_node": 8, "time": "01:00:00"}
    assert _where("--slurm").slurm == {} and _where().slurm is None and _where().target == "local"


def test_a_request_on_several_nodes_or_slurm_is_launched_and_bad_combinations_are_refused(tmp_path: Path) -> None:
    request = replay_request(What(SNAPSHOT), Where(targets=("a", "b")), workspace=tmp_path)
    assert launched(request) and not request.runs_here
    slurm = replay_request(What(SNAPSHOT), Where(slurm={"partition": "gpu", "nodes": 2}), workspace=tmp_path)
    assert launched(slurm) and slurm.where.slurm == {"partition": "gpu", "nodes": 2}
    assert replay_request(What(SNAPSHOT), Where(targets=("a",)), workspace=tmp_path).where.target == "a"
    refused = [
        (Where(target="a", targets=("b", "c")), "not both"),
        (Where(targets=("a", "a")), "names a node twice"),
        (Where(targets=("a", "b"), backend="command"), "several nodes and Slurm run the built-in torch engine"),
        (Where(slurm={"partition": "gpu", "qos": "high"}), r"unknown setting\(s\) qos"),
        (Where(slurm={"time": "soon"}), "give minutes, HH:MM:SS"),
        (Where(slurm={"nodes": 0}), "whole number of at least 1"),
    ]
    for where, message in refused:
        with pytest.raises(ConfigError, match=message):
            replay_request(What(SNAPSHOT), where, workspace=tmp_path)
    with pytest.raises(ConfigError, match="attribution runs here"):
        replay_request(What(SNAPSHOT, verb="attribute"), Where(targets=("a", "b")), workspace=tmp_path)
