"""A replay sent to a node carries the request's `What` and `How` as they are: the node's command line states every
declared field they set off its default, as its declaration spells the option, and the node's own parser reads each
back; so a new option reaches the node without a change to the remote side. A request at its defaults sends the same
command line as before the parts were carried whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from axrl_spike_replay.cli import build_parser
from axrl_spike_replay.experiment.request.request_fields import declared_fields
from axrl_spike_replay.experiment.request.request_parts import How, What
from axrl_spike_replay.remote.nodes.results import snapshot_facts
from axrl_spike_replay.remote.remote_replay import RemoteReplayRequest, remote_argv
from axrl_spike_replay.vocabulary import Device, Shard, Verb

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
SNAPSHOT = sorted((GOLDEN / "checkpoints" / "spike_snapshots").glob("iter_*"))[-1]


@pytest.mark.parametrize("shard", list(Shard))
def test_the_node_command_carries_the_shard_choice(shard: Shard) -> None:
    request = RemoteReplayRequest(
        facts=snapshot_facts(SNAPSHOT), python="python3", what=What(SNAPSHOT), how=How(shard=shard)
    )
    argv = remote_argv(request, "/tmp/ws", 2, None)
    assert ("--shard" in argv) == (shard != Shard.AUTO)
    args = build_parser().parse_args(argv[3:])  # what `python -m axrl_spike_replay` parses on the node
    assert args.shard == shard and args.nproc == 2


def test_a_request_at_its_defaults_sends_the_command_line_it_always_did() -> None:
    request = RemoteReplayRequest(facts=snapshot_facts(SNAPSHOT), python="python3", what=What(SNAPSHOT), job="j")
    assert remote_argv(request, "/tmp/ws", 2, None) == [
        "python3", "-m", "axrl_spike_replay", "replay", str(SNAPSHOT.resolve()), "--json",
        "--workspace", "/tmp/ws", "--job", "j", "--device", "cpu", "--nproc", "2",
    ]  # fmt: skip


def _off_default(kind: str, default: Any, choices: Any, ge: float | None) -> Any:
    if kind == "choice":
        return next(member for member in choices if member != default)
    if kind == "int":
        return default + 1 if isinstance(default, int) else int(ge or 1) + 1
    if kind == "float":
        return 4.5
    return not default


@pytest.mark.parametrize("verb", [Verb.REPLAY, Verb.SWEEP])
def test_every_declared_option_the_node_takes_reaches_its_parser(verb: Verb) -> None:
    """Each `What` and `How` field the verb's command line takes (the node's `nproc` is planned here, `device` always
    stated), set off its default, is read back by the node's parser with the request's value."""
    given: dict[type, dict[str, Any]] = {What: {}, How: {}}
    for part in (What, How):
        for name, d, default in declared_fields(part):
            if d.cli and verb in d.verbs and d.kind != "any" and name != "nproc":
                given[part][name] = _off_default(d.kind, default, d.choices, d.ge)
    assert "repeat" in given[What] or verb == Verb.SWEEP
    assert given[How]["device"] == Device.CUDA
    what, how = What(SNAPSHOT, verb=verb, **given[What]), How(**given[How])
    request = RemoteReplayRequest(facts=snapshot_facts(SNAPSHOT), python="python3", what=what, how=how)
    argv = remote_argv(request, "/tmp/ws", 3, "/tmp/ws/mitigation_set.yaml" if verb == Verb.SWEEP else None)
    args = build_parser().parse_args(argv[3:])
    assert args.nproc == 3
    for values in given.values():
        for name, value in values.items():
            parsed = getattr(args, name)
            assert parsed == str(value) if isinstance(value, (Device, Shard)) else parsed == value, (name, parsed)
    plain = RemoteReplayRequest(facts=snapshot_facts(SNAPSHOT), python="python3", what=What(SNAPSHOT, verb=verb))
    assert "--repeat" not in remote_argv(plain, "/tmp/ws", 2, None)
