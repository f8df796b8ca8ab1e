"""Over stdio, every request gets a reply: a lone UTF-16 surrogate in any string argument (which a JavaScript
client sends for a string cut inside an emoji) gets a JSON-RPC error naming the argument, and the session goes
on; `repeat` has an upper bound, stated in the tool's schema and enforced with a clear error."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp.types import INVALID_PARAMS, jsonrpc_message_adapter
from server_helpers import call, error_text, server_command

from axrl_spike_replay.experiment.request.request_parts import MAX_REPEAT

GUARD_S = 120.0  # a hang guard: the old server never answered; never a measured time


@asynccontextmanager
async def stdio_client_sending_any_text(workspace: Path) -> AsyncIterator[ClientSession]:
    """A real MCP client session on the server's stdio, through a transport that writes each message with
    Python's json (which, as a JavaScript client does, escapes a lone surrogate instead of refusing it)."""
    argv = [*server_command(), "mcp", "--workspace", str(workspace), "--no-warm"]
    process = await anyio.open_process(argv, stderr=subprocess.DEVNULL)
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout
    to_client, client_reads = anyio.create_memory_object_stream[SessionMessage | Exception](16)
    client_writes, to_server = anyio.create_memory_object_stream[SessionMessage](16)

    async def read_lines() -> None:
        pending = b""
        async with to_client:
            async for chunk in stdout:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    await to_client.send(SessionMessage(jsonrpc_message_adapter.validate_json(line)))

    async def write_lines() -> None:
        async with to_server:
            async for message in to_server:
                doc = message.message.model_dump(by_alias=True, exclude_unset=True)
                await stdin.send(json.dumps(doc).encode() + b"\n")

    async with anyio.create_task_group() as group:
        group.start_soon(read_lines)
        group.start_soon(write_lines)
        try:
            async with ClientSession(client_reads, client_writes) as session:
                await session.initialize()
                yield session
        finally:
            await stdin.aclose()
            with anyio.move_on_after(30):
                await process.wait()
            if process.returncode is None:
                process.kill()
            group.cancel_scope.cancel()


CASES = [
    ("inspect_snapshot", {"snapshot": "iter_\ud800"}, "params.arguments.snapshot"),
    ("replay", {"snapshot": "s", "mitigations": {"advantage_clip": "\udcff"}}, "params.arguments.mitigations"),
    ("task_note", {"job": "j", "section": "observations", "text": ["a", "\udfff"]}, "params.arguments.text[1]"),
]


@pytest.fixture(scope="module")
def replies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, list[str]]]:
    """{tool: (what its call got, an error or a result; the tools listed right after)} of one stdio session that
    sends every case in turn: one server process for the module, each call followed by a request the same session
    must answer."""
    workspace = tmp_path_factory.mktemp("untrusted-text") / "workspace"
    workspace.mkdir()

    async def story() -> dict[str, tuple[object, list[str]]]:
        got: dict[str, tuple[object, list[str]]] = {}
        async with stdio_client_sending_any_text(workspace) as session:
            for tool, arguments, _ in CASES:
                with anyio.fail_after(GUARD_S):
                    try:
                        answer: object = await session.call_tool(tool, arguments)
                    except MCPError as exc:
                        answer = exc
                    listed = await session.list_tools()  # the same session still answers
                got[tool] = (answer, [t.name for t in listed.tools])
        return got

    return anyio.run(story)


@pytest.mark.parametrize(("tool", "arguments", "where"), CASES)
def test_a_lone_surrogate_in_an_argument_gets_an_error_reply_and_the_session_goes_on(
    replies: dict[str, tuple[object, list[str]]], tool: str, arguments: dict[str, Any], where: str
) -> None:
    refused, tools = replies[tool]
    assert isinstance(refused, MCPError), refused
    assert refused.error.code == INVALID_PARAMS
    assert refused.error.message.startswith(where) and "lone UTF-16 surrogate" in refused.error.message
    assert tool in tools


def test_repeat_has_an_upper_bound_in_the_schema_and_in_the_library(workspace: Path) -> None:
    from axrl_spike_replay.errors import ConfigError
    from axrl_spike_replay.investigation.request import What, replay_request

    message = error_text(call(workspace, "replay", {"snapshot": "s", "repeat": 10**9}))
    assert "repeat" in message and str(MAX_REPEAT) in message and len(message) < 1000
    with pytest.raises(ConfigError, match=rf"`repeat` must be an integer from 1 to {MAX_REPEAT}, got 1000000000"):
        replay_request(What("s", repeat=10**9))
