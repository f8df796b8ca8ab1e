#!/usr/bin/env python3
"""MCP tool-call overhead and server cold start, side by side in one run.

1. `inspect_snapshot` on the golden fixture snapshot: p50 of N calls each of the direct library call, the
   in-process MCP client and the MCP server over real stdio; prints the ratios to the direct call.
2. Cold start: a fresh `axrl-spike-replay mcp` process until it answers `tools/list` (p50 of K starts),
   next to a bare `python -c "import torch"` — what every start would cost if the server imported torch.

Usage: .venv/bin/python benchmarks/bench_mcp.py [--calls N] [--starts K] [--snapshot DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "outputs" / "fx~fixture-moe__actor" / "checkpoints" / "spike_snapshots"


def _default_snapshot() -> Path:
    found = sorted(p for p in FIXTURE.glob("iter_*") if p.is_dir())
    if not found:
        raise SystemExit(f"no fixture snapshot under {FIXTURE}; run scripts/make_fixtures.py or pass --snapshot")
    return found[0]


def _server_cmd(workspace: Path) -> StdioServerParameters:
    script = Path(sys.executable).parent / "axrl-spike-replay"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "axrl_spike_replay"]
    return StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])


def _p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000.0


def bench_direct(snapshot: Path, calls: int) -> list[float]:
    """Seconds per direct `inspect_snapshot` call (after one warm-up)."""
    from axrl_spike_replay.snapshot.inspect import inspect_snapshot

    inspect_snapshot(snapshot)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        inspect_snapshot(snapshot)
        times.append(time.perf_counter() - start)
    return times


async def _mcp_calls(client: Client, snapshot: Path, calls: int) -> list[float]:
    args = {"snapshot": str(snapshot)}
    first = await client.call_tool("inspect_snapshot", args)
    if first.is_error:
        raise SystemExit(f"inspect_snapshot failed over MCP: {first.content[0].text}")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await client.call_tool("inspect_snapshot", args)
        times.append(time.perf_counter() - start)
    return times


def _run(server: object, body: Callable[[Client], Awaitable[list[float]]]) -> list[float]:
    async def main() -> list[float]:
        async with Client(server) as client:
            return await body(client)

    return anyio.run(main)


def bench_in_process(snapshot: Path, calls: int) -> list[float]:
    """Seconds per call through an in-process MCP client."""
    from axrl_spike_replay.server import create_server

    return _run(create_server(snapshot.parent), lambda c: _mcp_calls(c, snapshot, calls))


def bench_stdio(snapshot: Path, calls: int) -> list[float]:
    """Seconds per call to the server over stdio (a separate process, JSON-RPC framing)."""
    return _run(_server_cmd(snapshot.parent), lambda c: _mcp_calls(c, snapshot, calls))


def bench_cold_start(starts: int, workspace: Path) -> list[float]:
    """Seconds from spawning the server to its `tools/list` answer."""

    async def once() -> float:
        start = time.perf_counter()
        async with Client(_server_cmd(workspace)) as client:
            tools = await client.list_tools()
            elapsed = time.perf_counter() - start
        if not tools.tools:
            raise SystemExit("the server listed no tools")
        return elapsed

    return [anyio.run(once) for _ in range(starts)]


def bench_torch_import(starts: int) -> list[float]:
    """Seconds for a bare `python -c "import torch"` (what an eager-import server would add to every start)."""
    times = []
    for _ in range(starts):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MCP tool-call overhead and cold start")
    parser.add_argument("--calls", type=int, default=50, help="calls per way (default 50)")
    parser.add_argument("--starts", type=int, default=5, help="cold starts (default 5)")
    parser.add_argument("--snapshot", type=Path, default=None, help="snapshot dir (default: the golden fixture)")
    args = parser.parse_args(argv)
    snapshot = (args.snapshot or _default_snapshot()).resolve()
    print(f"snapshot: {snapshot}")

    direct = _p50_ms(bench_direct(snapshot, args.calls))
    inproc = _p50_ms(bench_in_process(snapshot, args.calls))
    stdio = _p50_ms(bench_stdio(snapshot, args.calls))
    print(f"inspect_snapshot p50 over {args.calls} calls:")
    print(f"  direct library call   {direct:8.2f} ms")
    print(f"  MCP in-process        {inproc:8.2f} ms   ({inproc / direct:5.2f}x direct, +{inproc - direct:.2f} ms)")
    print(f"  MCP over stdio        {stdio:8.2f} ms   ({stdio / direct:5.2f}x direct, +{stdio - direct:.2f} ms)")

    cold = _p50_ms(bench_cold_start(args.starts, snapshot.parent))
    torch_import = _p50_ms(bench_torch_import(args.starts))
    print(f"cold start to tools/list, p50 of {args.starts}: {cold:.0f} ms")
    print(f"  bare `import torch` process, p50: {torch_import:.0f} ms (an eager-import server would add it)")
    print(f"  ratio (cold start + torch) / cold start: {(cold + torch_import) / cold:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
