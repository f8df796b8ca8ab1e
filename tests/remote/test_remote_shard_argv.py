"""A replay sent to a node asks the node's CLI for the same sharding: `--shard` goes into the command line the node
runs (when it is not the default), and the node's own parser reads it back; so does every other option the request
sets, as its field's declaration spells it."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.cli import build_parser
from axrl_spike_replay.experiment.request.request_fields import changed_argv, declared_fields
from axrl_spike_replay.experiment.request.request_parts import What
from axrl_spike_replay.remote.nodes.results import snapshot_facts
from axrl_spike_replay.remote.remote_replay import RemoteReplayRequest, remote_argv
from axrl_spike_replay.vocabulary import Verb

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"


@pytest.mark.parametrize("shard", ["on", "off", "auto"])
def test_the_node_command_carries_the_shard_choice(shard: str) -> None:
    snapshot = sorted((GOLDEN / "checkpoints" / "spike_snapshots").glob("iter_*"))[-1]
    request = RemoteReplayRequest(facts=snapshot_facts(snapshot), python="python3", shard=shard)
    argv = remote_argv(request, "/tmp/ws", 2, None)
    assert ("--shard" in argv) == (shard != "auto")
    args = build_parser().parse_args(argv[3:])  # what `python -m axrl_spike_replay` parses on the node
    assert args.shard == shard and args.nproc == 2


def test_the_node_command_carries_every_option_the_request_sets_as_declared() -> None:
    snapshot = sorted((GOLDEN / "checkpoints" / "spike_snapshots").glob("iter_*"))[-1]
    given = {"repeat": 3, "clear_threshold": 4.5}  # two of the replay's declared options, off their defaults
    taken = {n for n, d, _ in declared_fields(What) if d.cli and Verb.REPLAY in d.verbs}
    assert set(given) <= taken
    what = What(snapshot, **given)
    request = RemoteReplayRequest(
        facts=snapshot_facts(snapshot), python="python3", options=tuple(changed_argv(what, Verb.REPLAY))
    )
    args = build_parser().parse_args(remote_argv(request, "/tmp/ws", 2, None)[3:])
    assert {name: getattr(args, name) for name in taken} == {name: getattr(what, name) for name in taken}
    plain = RemoteReplayRequest(
        facts=snapshot_facts(snapshot), python="python3", options=tuple(changed_argv(What(snapshot), Verb.REPLAY))
    )
    assert plain.options == () and "--repeat" not in remote_argv(plain, "/tmp/ws", 2, None)
