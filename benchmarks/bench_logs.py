"""Benchmark: `logs` vs `grep -c ""` on a generated Megatron training log (1 GB by default).

`--shape verl` writes verl-style key=value lines instead (`step:12 - actor/grad_norm:3.1 - ...`, ~35 metrics
a line, plus a `step=12 grad_norm=... loss=...` line): those are parsed line by line, far slower.

Each command runs in its own process on the same file, read from the page cache (a first `cat` warms it), each
after a `sync` (so none pays for writing back what the one before wrote), each `logs` into a fresh copy dir.
`logs` runs for people and with `--json` (a bounded, compact document), each twice, interleaved: the best and
the worst are shown, as the copy of the log needs fresh page cache whose cost depends on what the machine holds.
Reported: wall time, throughput, ratio to grep and peak RSS (`wait4`'s ru_maxrss for that child: at least the
launching process's RSS, ~15 MiB, carried across exec, so grep's figure is an upper bound). `logs` copies the
log beside its scan and, run from the CLI on a log of 64 MB or more, scans its two halves on two cores.
Target: within 10x of grep, >= 100 MB/s.

    .venv/bin/python benchmarks/bench_logs.py [--mb 1024] [--dir DIR] [--shape megatron|verl]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mcp_server"


def write_log(path: Path, size_bytes: int) -> int:
    """A Megatron-style log of about `size_bytes`: a 20x spike every 50 000 iterations, a warning line every
    1000. Returns the number of iterations."""
    iteration = 0
    written = 0
    with path.open("w") as handle:
        while written < size_bytes:
            lines = []
            for _ in range(1000):
                iteration += 1
                grad = 20.0 if iteration % 50_000 == 0 else 1.0 + (iteration % 13) / 100
                lines.append(
                    f" [2026-11-30 10:00:00] iteration {iteration:8d}/ 10000000 | consumed samples: "
                    f"{iteration * 256:12d} | elapsed time per iteration (ms): 812.3 | learning rate: 1.000000E-06 | "
                    f"global batch size:   256 | lm loss: {1.0 + (iteration % 97) / 1000:.6E} | loss scale: 1.0 | "
                    f"grad norm: {grad:.3f} | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
                )
            lines.append("WARNING: dataloader worker slow to respond\n")
            block = "".join(lines)
            handle.write(block)
            written += len(block)
    return iteration


def write_verl_log(path: Path, size_bytes: int) -> int:
    """A verl-style key=value log of about `size_bytes`, a 20x spike every 5000 steps. Returns the steps."""
    step = 0
    written = 0
    with path.open("w") as handle:
        while written < size_bytes:
            lines = []
            for _ in range(100):
                step += 1
                grad = 20.0 if step % 5000 == 0 else 1.0 + (step % 13) / 100
                metrics = " - ".join(f"actor/metric_{k}:{(step * k) % 1000 / 997:.4f}" for k in range(32))
                lines.append(
                    f"(main_task pid=1234) step:{step} - actor/pg_loss:{(step % 97) / 1000:.4f} - "
                    f"actor/grad_norm:{grad:.4f} - {metrics} - critic/score/mean:0.512\n"
                )
            block = "".join(lines)
            handle.write(block)
            written += len(block)
    return step


def measured(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, int, bytes]:
    """(seconds, peak RSS in KiB, stdout) of one child process, started after a `sync`."""
    os.sync()
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out = child.stdout.read() if child.stdout else b""
    err = child.stderr.read() if child.stderr else b""
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({child.returncode}): {err.decode(errors='replace')[-2000:]}")
    return seconds, usage.ru_maxrss, out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", type=float, default=1024, help="size of the generated log in MiB (default 1024)")
    parser.add_argument("--dir", default=None, help="where to write the log and its copies (default: a temp dir)")
    parser.add_argument("--shape", choices=("megatron", "verl"), default="megatron", help="the lines of the log")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-logs-", dir=args.dir))
    try:
        log = root / "train.log"
        write = write_log if args.shape == "megatron" else write_verl_log
        iterations = write(log, int(args.mb * 1024 * 1024))
        size_mb = log.stat().st_size / 1e6
        subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        env = {**os.environ, "PYTHONPATH": str(PACKAGE)}
        cli = [sys.executable, "-m", "axrl_spike_replay", "logs", str(log), "--dest", str(root / "copies")]
        grep_s, grep_rss, grep_out = measured(["grep", "-c", "", str(log)])
        runs: dict[str, list[tuple[float, int, bytes]]] = {"logs:": [], "logs --json:": []}
        for _ in range(2):
            for name, extra in (("logs:", []), ("logs --json:", ["--json"])):
                runs[name].append(measured([*cli, *extra], env))
                shutil.rmtree(root / "copies")
        print(f"{args.shape} log: {size_mb:.0f} MB, {int(grep_out)} lines, {iterations} iterations")
        print(f"grep -c:       {grep_s:7.2f} s  {size_mb / grep_s:8.0f} MB/s  peak RSS {grep_rss / 1024:6.1f} MiB")
        for name, measures in runs.items():
            best, worst = min(m[0] for m in measures), max(m[0] for m in measures)
            rss = max(m[1] for m in measures)
            print(
                f"{name:<14}{best:7.2f} s  {size_mb / best:8.0f} MB/s  peak RSS {rss / 1024:6.1f} MiB  "
                f"{best / grep_s:6.1f}x grep  (worst of 2: {worst:.2f} s, {worst / grep_s:.1f}x)"
            )
        json_out, human_out = runs["logs --json:"][0][2], runs["logs:"][0][2]
        print(f"--json document: {len(json_out) / 1e3:.0f} kB; people's summary: {human_out.decode().splitlines()[0]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
