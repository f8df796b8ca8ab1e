#!/usr/bin/env python3
"""Warm replay service: the first vs the second MCP `replay` call in one server session, side by side in one run.

The first call starts the rank processes (torch, DCP, process group) and loads the weights; the second
reuses both and should cost about its own arithmetic. Prints second/first (goal <= 0.2 at fixture size)
and the second call against its own `load + compute` figures (goal: second <= 2 x (load + compute) + 0.5 s).

Usage: .venv/bin/python benchmarks/bench_warm_replay.py [--snapshot DIR] [--nproc N] [--calls K]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "outputs" / "fx~fixture-moe__actor" / "checkpoints" / "spike_snapshots"


def _default_snapshot() -> Path:
    found = sorted(p for p in FIXTURE.glob("iter_*") if p.is_dir())
    if not found:
        raise SystemExit(f"no fixture snapshot under {FIXTURE}; run scripts/make_fixtures.py or pass --snapshot")
    return found[0]


async def _calls(workspace: Path, args: dict[str, Any], calls: int) -> list[tuple[float, dict[str, Any]]]:
    from axrl_spike_replay.server import create_server

    out = []
    async with Client(create_server(workspace)) as client:
        for _ in range(calls):
            start = time.perf_counter()
            result = await client.call_tool("replay", args)
            wall = time.perf_counter() - start
            if result.is_error:
                raise SystemExit(f"replay failed: {result.content[0].text}")
            out.append((wall, result.structured_content or {}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot", type=Path, default=None)
    parser.add_argument("--nproc", type=int, default=None, help="default: the saved world size")
    parser.add_argument("--calls", type=int, default=3, help="calls in one session (>= 2); later ones: the median")
    args = parser.parse_args()
    snapshot = (args.snapshot or _default_snapshot()).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        copy = Path(tmp) / "snapshot"
        shutil.copytree(snapshot, copy)
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        call = {"snapshot": str(copy), **({"nproc": args.nproc} if args.nproc else {})}
        runs = anyio.run(_calls, workspace, call, max(args.calls, 2))
    first, later = runs[0][0], runs[1:]
    second = statistics.median(wall for wall, _ in later)
    work = statistics.median(r["timings"]["load"] + r["timings"]["compute"] for _, r in later)
    nproc = runs[0][1].get("world_size_used")
    print(f"snapshot {snapshot.name}, {nproc} process(es), {len(runs)} MCP replay calls in one server session")
    print(f"  first call (starts the processes, loads the weights): {first:.2f} s")
    print(f"  later calls (median):                                 {second:.3f} s")
    print(f"  their own load + compute (median):                    {work:.3f} s")
    print(f"  ratio second/first: {second / first:.3f} (goal <= 0.2)")
    bound = 2 * work + 0.5
    print(
        f"  ratio second/(load + compute): {second / work:.1f}x; second {second:.3f} s vs 2 x (load + compute) + 0.5 s "
        f"= {bound:.3f} s: {'met' if second <= bound else 'NOT met'}"
    )


if __name__ == "__main__":  # the warm processes are spawned: they import this module without running it
    main()
