#!/usr/bin/env python3
"""Starting rank processes: forked from a server that imported torch once vs spawned (a Python start and a torch
import per process), side by side.

1. The library: 2 do-nothing rank processes through `spawn_ranks` (a gloo group formed and torn down), the first
   and the second start from one process that has imported torch, for each start method (each in a fresh process,
   `AXRL_START_METHOD` picking the method).
2. A warm pool (the MCP server's and `serve`'s): the first and a second start of a 2-process pool, for each method.
3. The CLI: a cold `replay --nproc 1` and `--nproc 2` of the golden fixture's spike snapshot (world size 2), wall
   each, in fresh processes, for each method; the ratio nproc 2 / nproc 1 (goal: ≤ 1.5 with the forkserver).
4. A cold `replay --nproc 2` of a tiny transformers MoE snapshot (qwen3_moe, world size 2), wall, in fresh
   processes: its process server started without the model's libraries (each rank imports transformers after the
   fork, the naive way), and with the `hf` preload (the server imports them once, before it forks), alternating.

Runs alternate between the methods; medians of --runs. Usage:
    .venv/bin/python benchmarks/bench_process_starts.py [--runs 3] [--skip-cli] [--only-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests/fixtures/outputs/fx~fixture-moe__actor/checkpoints/spike_snapshots/iter_0000021"
METHODS = ("spawn", "forkserver")

_LIBRARY = """
import json, time
import torch  # the launcher has torch, as a replay or a capture has by the time it starts its ranks
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from bench_process_starts import do_nothing
times = []
for _ in range(2):
    start = time.perf_counter()
    spawn_ranks(do_nothing, 2, None)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""

_POOL = """
import json, time
import torch
from axrl_spike_replay.replay.jobs.warm_pool import PoolKey, RankPool
times = []
for _ in range(2):
    start = time.perf_counter()
    pool = RankPool(PoolKey(2, "cpu", 60.0), 1 << 30)
    times.append(time.perf_counter() - start)
    pool.close()
print(json.dumps(times))
"""

# A cold replay whose process server is launched first, with or without the model kind's preload; the replay's
# own request for it then finds the server running (a running server keeps its imports).
_HF_REPLAY = """
import contextlib, io, json, sys, time
from axrl_spike_replay.processes.process_starts import warm_up
warm_up(tuple(kind for kind in sys.argv[1].split(",") if kind))
from axrl_spike_replay.cli import main
times = []
for _ in range(2):  # a first replay (the server's imports pending), then a second one from the same server
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(sys.argv[2:])
    if code:
        raise SystemExit(code)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def do_nothing(rank: int, nproc: int, payload: object) -> None:
    """A rank's work that takes no time: what is left is starting the process and forming the group."""


def _env(method: str) -> dict[str, str]:
    path = os.pathsep.join((str(ROOT / "mcp_server"), str(Path(__file__).resolve().parent)))
    return {**os.environ, "AXRL_START_METHOD": method, "PYTHONPATH": path}


def _in_fresh_process(code: str, method: str) -> list[float]:
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(method), capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{method}: {done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cli_wall(method: str, nproc: int, workspace: Path) -> float:
    argv = [sys.executable, "-m", "axrl_spike_replay", "replay", str(SNAPSHOT), "--nproc", str(nproc)]
    start = time.perf_counter()
    done = subprocess.run(
        [*argv, "--workspace", str(workspace), "--json"], env=_env(method), capture_output=True, text=True, timeout=900
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"replay --nproc {nproc} ({method}): {done.stderr}")
    return wall


def _hf_snapshot(root: Path) -> Path:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from axrl_spike_replay.testing.hf_snapshot "
            "import record_hf_snapshot; print(record_hf_snapshot(Path(sys.argv[1]), 'qwen3_moe', world_size=2))",
            str(root),
        ],
        env=_env("forkserver"),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"recording the HF snapshot: {done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def _hf_replay_walls(kinds: str, snapshot: Path, workspace: Path) -> list[float]:
    """Wall of the whole cold process (two replays), then each replay's time in it."""
    argv = ["replay", str(snapshot), "--nproc", "2", "--workspace", str(workspace), "--json"]
    env = {k: v for k, v in _env("forkserver").items() if k != "AXRL_PRELOAD"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _HF_REPLAY, kinds, *argv], env=env, capture_output=True, text=True, timeout=900
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"HF replay --nproc 2 (preload {kinds or 'none'}): {done.stderr}")
    return [wall, *json.loads(done.stdout.strip().splitlines()[-1])]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-cli", action="store_true", help="leave out part 3 (cold CLI replays)")
    parser.add_argument("--only-hf", action="store_true", help="run part 4 only (the HF replay's preload)")
    args = parser.parse_args()
    if args.only_hf:
        return _hf_part(args.runs)
    median = statistics.median
    library: dict[str, list[list[float]]] = {m: [] for m in METHODS}
    pool: dict[str, list[list[float]]] = {m: [] for m in METHODS}
    cli: dict[tuple[str, int], list[float]] = {(m, n): [] for m in METHODS for n in (1, 2)}
    with tempfile.TemporaryDirectory(prefix="bench-starts-") as tmp:
        for _ in range(args.runs):
            for method in METHODS:
                library[method].append(_in_fresh_process(_LIBRARY, method))
                pool[method].append(_in_fresh_process(_POOL, method))
                if not args.skip_cli:
                    for nproc in (1, 2):
                        cli[method, nproc].append(_cli_wall(method, nproc, Path(tmp)))

    print(f"starting 2 rank processes, medians of {args.runs} (first start / second start in one process):")
    for name, table in (("spawn_ranks", library), ("warm pool  ", pool)):
        first = {m: median(t[0] for t in table[m]) for m in METHODS}
        second = {m: median(t[1] for t in table[m]) for m in METHODS}
        print(
            f"  {name}: spawn {first['spawn']:.2f} s / {second['spawn']:.2f} s;  forkserver "
            f"{first['forkserver']:.2f} s / {second['forkserver']:.3f} s;  second start spawn / forkserver "
            f"{second['spawn'] / second['forkserver']:.0f}x (goal: forkserver second start < 0.5 s)"
        )
    if not args.skip_cli:
        print(f"cold CLI replay of {SNAPSHOT.name} (saved world size 2), wall, medians of {args.runs}:")
        for method in METHODS:
            one, two = median(cli[method, 1]), median(cli[method, 2])
            print(f"  {method:10}: --nproc 1 {one:.2f} s, --nproc 2 {two:.2f} s: {two / one:.2f}x (goal ≤ 1.5x)")
    return _hf_part(args.runs)


def _hf_part(runs: int) -> int:
    walls: dict[str, list[list[float]]] = {"": [], "hf": []}
    with tempfile.TemporaryDirectory(prefix="bench-preload-") as tmp:
        snapshot = _hf_snapshot(Path(tmp, "snap"))
        Path(tmp, "ws").mkdir()
        for _ in range(runs):
            for kinds in walls:
                walls[kinds].append(_hf_replay_walls(kinds, snapshot, Path(tmp, "ws")))
    print(f"replay --nproc 2 of a qwen3_moe snapshot (world size 2) in a fresh process, twice; medians of {runs}:")
    medians = {kinds: [statistics.median(run[i] for run in walls[kinds]) for i in range(3)] for kinds in walls}
    for kinds, label in (("", "server without preload"), ("hf", "server with hf preload ")):
        shown = "; ".join(f"{w:.2f} / {f:.2f} / {s:.2f}" for w, f, s in walls[kinds])
        total, first, second = medians[kinds]
        print(f"  {label}: process {total:.2f} s, first replay {first:.2f} s, second {second:.2f} s  (runs: {shown})")
    ratios = [n / p for n, p in zip(medians[""], medians["hf"], strict=True)]
    print(f"  without / with: process {ratios[0]:.2f}x, first replay {ratios[1]:.2f}x, second replay {ratios[2]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
