"""A replay sent to a node asks the node's CLI for the same sharding: `--shard` goes into the command line the node
runs (when it is not the default), and the node's own parser reads it back."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.cli import build_parser
from axrl_spike_replay.remote.nodes.results import snapshot_facts
from axrl_spike_replay.remote.remote_replay import RemoteReplayRequest, remote_argv

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"


@pytest.mark.parametrize("shard", ["on", "off", "auto"])
def test_the_node_command_carries_the_shard_choice(shard: str) -> None:
    snapshot = sorted((GOLDEN / "checkpoints" / "spike_snapshots").glob("iter_*"))[-1]
    request = RemoteReplayRequest(facts=snapshot_facts(snapshot), python="python3", shard=shard)
    argv = remote_argv(request, "/tmp/ws", 2, None)
    assert ("--shard" in argv) == (shard != "auto")
    args = build_parser().parse_args(argv[3:])  # what `python -m axrl_spike_replay` parses on the node
    assert args.shard == shard and args.nproc == 2
