"""Helpers shared by the MCP server tests: the fixture job's figures and MCP client calls."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
from mcp import Client
from mcp.types import CallToolResult

from axrl_spike_replay.server import create_server

JOB = "fx-server-moe"
ITERATION = 7
RECORDED = 31.5
MEDIAN = 2.5
T = TypeVar("T")


@dataclass
class SpikeOutputs:
    root: Path  # holds `run1~<job>__actor`
    output_dir: Path
    snapshot: Path  # the retained (rotating) snapshot dir
    log: Path


def with_client(server: Any, body: Callable[[Client], Awaitable[T]]) -> T:
    """Run `body(client)` against `server` (an MCPServer in-process, or stdio parameters, or a URL)."""

    async def main() -> T:
        async with Client(server) as client:
            return await body(client)

    return anyio.run(main)


def call(workspace: Path, tool: str, arguments: dict[str, Any]) -> CallToolResult:
    """One tool call on a fresh in-process server whose workspace is `workspace`."""
    server = create_server(workspace)
    return with_client(server, lambda client: client.call_tool(tool, arguments))


def ok(result: CallToolResult) -> dict[str, Any]:
    """The structured content of a successful call (fails the test with the tool's error text otherwise)."""
    assert not result.is_error, result.content[0].text if result.content else result
    assert result.structured_content is not None
    # The text block carries the same document for clients that read text only.
    assert json.loads(result.content[0].text) == result.structured_content
    return result.structured_content


def error_text(result: CallToolResult) -> str:
    """The text of a failed call (fails the test if the call succeeded)."""
    assert result.is_error, result.structured_content
    return result.content[0].text


def server_command() -> list[str]:
    """The console script of this environment, as an agent's config would name it."""
    script = Path(sys.executable).parent / "axrl-spike-replay"
    return [str(script)] if script.exists() else [sys.executable, "-m", "axrl_spike_replay"]
