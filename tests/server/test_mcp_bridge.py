"""How tools run library code: in a worker thread, progress always increasing, a cancelled call stops the work
it started before it returns, expected failures as tool errors and crashes without internals."""

from __future__ import annotations

import threading
import time

import anyio
from mcp import Client
from mcp.server.mcpserver import Context, MCPServer

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.mcp_faces.bridge import Progress, call_library


def _server(state: dict) -> MCPServer:
    server = MCPServer("bridge-test")

    @server.tool()
    async def long_work(steps: int, ctx: Context) -> int:
        """Counts steps until done or cancelled."""

        def work(progress: Progress, cancel: threading.Event) -> int:
            state["started"] = True
            for i in range(steps):
                if cancel.is_set():
                    state["stopped_at"] = i
                    return i
                progress(i + 1, steps, f"step {i + 1}")
                time.sleep(0.02)
            return steps

        return await call_library(ctx, work)

    @server.tool()
    async def fails(kind: str, ctx: Context) -> int:
        """Raises."""

        def work(progress: Progress, cancel: threading.Event) -> int:
            if kind == "expected":
                raise SnapshotError("/x/iter_0000001: snapshot directory not found")
            if kind == "os":
                raise PermissionError(13, "Permission denied", "/x/batch_rank0.pt")
            raise RuntimeError("internal detail that must not leak")

        return await call_library(ctx, work)

    return server


def test_progress_arrives_in_order_and_the_result_comes_back() -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def main():
        async with Client(_server({})) as client:

            async def on_progress(value: float, total: float | None, message: str | None) -> None:
                seen.append((value, total, message))

            return await client.call_tool("long_work", {"steps": 5}, progress_callback=on_progress)

    result = anyio.run(main)
    assert result.structured_content == {"result": 5}
    assert seen == [(float(i), 5.0, f"step {i}") for i in range(1, 6)]


def test_a_cancelled_call_stops_the_work_before_the_server_moves_on() -> None:
    state: dict = {}

    async def main():
        async with Client(_server(state)) as client:
            with anyio.move_on_after(0.3):
                await client.call_tool("long_work", {"steps": 10_000})
            # The server is still usable, and the abandoned work has stopped.
            return await client.call_tool("long_work", {"steps": 1})

    after = anyio.run(main)
    assert state["started"] and 0 < state["stopped_at"] < 10_000
    assert after.structured_content == {"result": 1}


def test_failures_become_tool_errors_with_the_library_message_only() -> None:
    async def main():
        async with Client(_server({})) as client:
            return [await client.call_tool("fails", {"kind": k}) for k in ("expected", "os", "crash")]

    expected, os_error, crash = anyio.run(main)
    assert expected.is_error and "/x/iter_0000001: snapshot directory not found" in expected.content[0].text
    assert os_error.is_error and "/x/batch_rank0.pt: Permission denied" in os_error.content[0].text
    assert crash.is_error and "internal detail" not in crash.content[0].text
