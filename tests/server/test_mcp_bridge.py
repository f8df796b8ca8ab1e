"""How tools run library code: in a worker thread, progress always increasing, a cancelled call stops the work
it started before it returns, expected failures as tool errors with the library's message, and crashes as tool
errors naming the exception's type and (bounded) message, with the traceback in the server's log only."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.server.mcpserver import Context, MCPServer
from server_helpers import with_client

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.mcp_faces.bridge import Progress, call_async_library, call_library
from axrl_spike_replay.server import create_server


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
    async def work_in_threads(threads: int, ctx: Context) -> int:
        """Reports one step from each of several threads of its own (as a sweep's pools do)."""

        def work(progress: Progress, cancel: threading.Event) -> int:
            started = [threading.Thread(target=progress.message, args=(f"thread {i}",)) for i in range(threads)]
            for thread in started:
                thread.start()
            for thread in started:
                thread.join()
            return threads

        return await call_library(ctx, work)

    @server.tool()
    async def fails(kind: str, ctx: Context) -> int:
        """Raises."""

        def work(progress: Progress, cancel: threading.Event) -> int:
            if kind == "expected":
                raise SnapshotError("/x/iter_0000001: snapshot directory not found")
            if kind == "os":
                raise PermissionError(13, "Permission denied", "/x/batch_rank0.pt")
            if kind == "long":
                raise ValueError("\x1b[31m" + "x" * 100_000)
            raise RuntimeError("cannot unpack the batch")

        return await call_library(ctx, work)

    @server.tool()
    async def fails_async(ctx: Context) -> int:
        """Raises in the event loop."""

        async def work(report) -> int:
            return {}["missing-key"]

        return await call_async_library(ctx, work)

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


def test_progress_from_threads_the_work_started_arrives_too() -> None:
    seen: list[str | None] = []

    async def main():
        async with Client(_server({})) as client:

            async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                seen.append(message)

            return await client.call_tool("work_in_threads", {"threads": 3}, progress_callback=on_progress)

    result = anyio.run(main)
    assert not result.is_error and result.structured_content == {"result": 3}
    assert sorted(m or "" for m in seen) == ["thread 0", "thread 1", "thread 2"]


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


def test_failures_become_tool_errors_with_the_library_message(caplog: pytest.LogCaptureFixture) -> None:
    async def main():
        async with Client(_server({})) as client:
            return [await client.call_tool("fails", {"kind": k}) for k in ("expected", "os")]

    expected, os_error = anyio.run(main)
    assert expected.is_error and "/x/iter_0000001: snapshot directory not found" in expected.content[0].text
    assert os_error.is_error and "/x/batch_rank0.pt: Permission denied" in os_error.content[0].text
    assert not [r for r in caplog.records if r.exc_info]  # expected failures are not crashes


def test_a_crash_names_its_type_and_message_and_logs_the_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def main():
        async with Client(_server({})) as client:
            return [
                await client.call_tool("fails", {"kind": "crash"}),
                await client.call_tool("fails", {"kind": "long"}),
                await client.call_tool("fails_async", {}),
            ]

    crash, long, in_loop = anyio.run(main)
    text = crash.content[0].text
    assert crash.is_error and "RuntimeError: cannot unpack the batch" in text
    assert "Traceback" not in text and 'File "' not in text  # the traceback stays on the server
    assert long.is_error and "ValueError" in long.content[0].text
    assert len(long.content[0].text) < 1000 and "\x1b" not in long.content[0].text
    assert in_loop.is_error and "KeyError: 'missing-key'" in in_loop.content[0].text
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 3 and logged[0].exc_info[0] is RuntimeError


def test_a_crash_outside_the_bridge_still_tells_the_caller_what_happened(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = create_server(tmp_path)

    @server.tool()
    def shape_result(name: str) -> int:
        """Fails while shaping its answer, not in library code."""
        return int(name)

    result = with_client(server, lambda client: client.call_tool("shape_result", {"name": "seven"}))
    text = result.content[0].text
    assert result.is_error
    assert text.startswith("Error executing tool shape_result: unexpected ValueError: invalid literal for int()")
    assert "Traceback" not in text
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [ValueError]
