#!/usr/bin/env python3
"""Run every benchmark in benchmarks/ (each `bench_*.py` in its own process, one after another) and print their
ratio lines together at the end.

A ratio line is one that says `ratio`, or gives a figure as `N.Nx` / `N×`. A benchmark that fails or runs past
`--timeout` is reported with its last lines and the run goes on.

Usage: .venv/bin/python benchmarks/run_all.py [--only NAME ...] [--skip NAME ...] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RATIO = re.compile(r"ratio|\d(\.\d+)?\s*[x×](\b|\s|$)", re.IGNORECASE)


def benchmarks(only: list[str], skip: list[str]) -> list[Path]:
    """The bench_*.py scripts to run, by name (`bench_logs` or `logs` both name bench_logs.py)."""

    def named(path: Path, names: list[str]) -> bool:
        return path.stem in names or path.stem.removeprefix("bench_") in names

    found = sorted(HERE.glob("bench_*.py"))
    return [p for p in found if (not only or named(p, only)) and not named(p, skip)]


def run(path: Path, timeout_s: float) -> tuple[str, list[str], float]:
    """(status, output lines, seconds) of one benchmark run with this interpreter."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(path)], capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        return f"timed out after {timeout_s:g} s", out.splitlines(), time.perf_counter() - start
    status = "ok" if done.returncode == 0 else f"exit code {done.returncode}"
    lines = done.stdout.splitlines() + ([] if done.returncode == 0 else done.stderr.splitlines()[-5:])
    return status, lines, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="run only these benchmarks")
    parser.add_argument("--skip", nargs="*", default=[], help="leave these out")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per benchmark")
    args = parser.parse_args()
    summary: list[str] = []
    failed = 0
    for path in benchmarks(args.only, args.skip):
        print(f"== {path.name}", flush=True)
        status, lines, seconds = run(path, args.timeout)
        for line in lines:
            print(f"   {line}")
        print(f"   ({status}, {seconds:.0f} s)", flush=True)
        ratios = [line.strip() for line in lines if RATIO.search(line)]
        if status != "ok":
            failed += 1
            ratios.append(f"FAILED: {status}")
        summary += [f"{path.stem}: {line}" for line in ratios] or [f"{path.stem}: (no ratio line)"]
    print("\n== ratios")
    for line in summary:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
