"""The MCP face takes `shard` on replay and sweep: a real client session asks for a sharded replay and gets the
unsharded grad norm, with `sharded: true` and the precision that ran in the result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from server_helpers import SpikeOutputs, ok, with_client

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.server import create_server
from axrl_spike_replay.vocabulary import Shard


def test_replay_and_sweep_offer_shard(workspace: Path) -> None:
    server = create_server(workspace)
    tools = {t.name: t for t in with_client(server, lambda client: client.list_tools()).tools}
    for name in ("replay", "sweep"):
        shard = tools[name].input_schema["properties"]["shard"]
        assert shard["enum"] == ["auto", "on", "off", "streamed"] and shard["default"] == "auto"


@pytest.mark.slow  # two replays of the fixture spike
def test_a_sharded_mcp_replay_gives_the_unsharded_grad_norm(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    server = create_server(workspace)

    async def body(client: Client) -> dict[str, Any]:
        args = {"snapshot": str(spike_outputs.snapshot), "nproc": 1, "shard": "on"}
        return ok(await client.call_tool("replay", args))

    sharded = with_client(server, body)
    whole = run_replay(replay_request(What(spike_outputs.snapshot), how=How(nproc=1, shard=Shard.OFF)))
    assert sharded["sharded"] is True and whole.sharded is False
    assert whole.grad_norm is not None
    assert abs(sharded["grad_norm"] - whole.grad_norm) <= 1e-6 * whole.grad_norm
    assert sharded["verdict"] == whole.verdict
    assert sharded["precision"]["source"] in ("run_config", "model_dtype")


def test_attribute_spike_and_diagnose_spike_offer_shard(workspace: Path) -> None:
    server = create_server(workspace)
    tools = {t.name: t for t in with_client(server, lambda client: client.list_tools()).tools}
    # an attribution shares the replay's declaration; diagnose has its own, whose signal check also runs streamed
    for name in ("attribute_spike", "diagnose_spike"):
        properties = tools[name].input_schema["properties"]
        assert properties["shard"]["enum"] == ["auto", "on", "off", "streamed"]
        assert properties["shard"]["default"] == "auto"
        assert "nproc" in properties


@pytest.mark.slow  # an unsharded and a two-process sharded attribution of the fixture spike
def test_a_sharded_mcp_attribution_gives_the_unsharded_figures(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    from axrl_spike_replay.investigation.request import How, What, replay_request
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike
    from axrl_spike_replay.vocabulary import Verb

    server = create_server(workspace)

    async def body(client: Client) -> dict[str, Any]:
        args = {"snapshot": str(spike_outputs.snapshot), "top": 100, "nproc": 2, "shard": "on"}
        return ok(await client.call_tool("attribute_spike", args))

    sharded = with_client(server, body)
    whole = attribute_spike(
        replay_request(What(spike_outputs.snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="off"))
    )
    assert sharded["sharded"] is True and sharded["world_size_used"] == 2 and whole.sharded is False
    norm = whole.grad_norm
    assert abs(sharded["grad_norm"] - norm) <= 1e-6 * norm
    want = whole.to_json()["samples"]
    assert [(s["rank"], s["sample"]) for s in sharded["samples"]] == [(s["rank"], s["sample"]) for s in want]
    for got, ref in zip(sharded["samples"], want, strict=True):
        assert abs(got["contribution"] - ref["contribution"]) <= 1e-6 * norm
