"""Benchmark: `inspect` of a snapshot whose files declare huge sizes vs the same snapshot honest, side by side.

The hostile copy declares a world size of 10^9 in its metadata, holds a grad info whose tensor is a
zip bomb (a few MB deflating to --bomb-gib GiB) and one whose pickle declares a 3 GiB tensor over
4 MiB of data, and a checkpoint `.metadata` declaring a 10^6 x 10^6 tensor. Each inspect runs in its
own fresh Python process (limited to --limit-gib of address space, so an unbounded reader fails
instead of swapping a shared machine) and reports its wall time and peak RSS (VmHWM). Target: the
hostile snapshot costs at most 1.5x the honest one in peak memory.

Then the worst case of each hostile class on the other surfaces, beside the honest case of the same size
(`hostile_surfaces.py`): a 100 MB output line without a newline from the command backend's job, a 64 MiB
warm-service frame, a logs dir of 16k files. Same target for each: at most 1.5x the honest case's peak memory.

    .venv/bin/python benchmarks/bench_hostile.py [--bomb-gib 3] [--package DIR] [--dir DIR]
        [--surfaces line,frame,logs|none] [--line-mb 100] [--frame-mib 64] [--log-files 16000]

`--package DIR` runs the children against another checkout's `mcp_server` (e.g. to measure before a fix).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the hostile-file writers the regression tests use

from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR  # noqa: E402
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot  # noqa: E402
from hostile_snapshot import (  # noqa: E402
    declare_checkpoint_tensor,
    declare_world_size,
    write_compressed_tensor_file,
    write_lying_tensor_file,
)
from hostile_surfaces import logs_dir_rows, output_line_rows, print_rows, warm_frame_rows  # noqa: E402

GIB = 1 << 30

INSPECT = """
import json, resource, sys, time
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import torch
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
t0 = time.perf_counter()
try:
    result = inspect_snapshot(sys.argv[1])
    longest = max(map(len, result.problems), default=0)
    outcome = {"ranks": len(result.ranks), "problems": len(result.problems), "longest": longest}
except BaseException as exc:
    outcome = {"failed": f"{type(exc).__name__}: {str(exc)[:160]}"}
t = time.perf_counter() - t0
hwm = [int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:')][0]
print(json.dumps({'seconds': t, 'peak_rss_kib': hwm, **outcome}))
"""


def run_child(snapshot: Path, package: Path, limit: int) -> dict:
    """inspect `snapshot` in a fresh interpreter importing the package under `package`; its JSON report."""
    env = {**os.environ, "PYTHONPATH": str(package)}
    done = subprocess.run(
        [sys.executable, "-c", INSPECT, str(snapshot), str(limit)], capture_output=True, text=True, env=env, check=False
    )
    lines = done.stdout.strip().splitlines()
    if not lines:
        return {"seconds": float("nan"), "peak_rss_kib": 0, "failed": f"exit {done.returncode}: {done.stderr[-300:]}"}
    return json.loads(lines[-1])


def make_pair(workdir: Path, bomb_gib: float) -> tuple[Path, Path]:
    """(honest, hostile): a synthetic 4-rank snapshot and a copy whose files declare huge sizes."""
    spec = SyntheticSpec(iteration=100, world_size=4, batch_size=8, seq_len=512, prompt_len=128, job_name="bench")
    honest = write_synthetic_snapshot(workdir / "honest~bench__actor" / SNAPSHOTS_DIR, spec)
    hostile = workdir / "hostile~bench__actor" / SNAPSHOTS_DIR / honest.name
    shutil.copytree(honest, hostile)
    declare_world_size(hostile, 10**9)
    write_compressed_tensor_file(hostile / "grad_info_rank0.pt", "grad_norm", int(bomb_gib * GIB))
    write_lying_tensor_file(hostile / "grad_info_rank1.pt", "grad_norm", 3 * GIB)
    declare_checkpoint_tensor(hostile, (10**6, 10**6))
    return honest, hostile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bomb-gib", type=float, default=3.0, help="what the zip-bomb grad info expands to")
    parser.add_argument("--limit-gib", type=float, default=8.0, help="address-space limit of each child")
    parser.add_argument("--package", default=str(REPO / "mcp_server"), help="the mcp_server dir to measure")
    parser.add_argument("--dir", default=None, help="where to write the snapshots (default: a temp dir)")
    parser.add_argument("--surfaces", default="line,frame,logs", help="other hostile classes to measure, or none")
    parser.add_argument("--line-mb", type=int, default=100, help="the output line without a newline, in MB")
    parser.add_argument("--frame-mib", type=int, default=64, help="the warm-service frame without a newline, in MiB")
    parser.add_argument("--log-files", type=int, default=16000, help="files in the hostile logs dir")
    parser.add_argument("--surface-timeout", type=float, default=900.0, help="seconds for each of those cases")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="axrl-bench-hostile-", dir=args.dir))
    limit = int(args.limit_gib * GIB)
    try:
        honest, hostile = make_pair(workdir, args.bomb_gib)
        bomb = (hostile / "grad_info_rank0.pt").stat().st_size
        rows = []
        for label, snapshot in (("honest", honest), ("hostile", hostile), ("honest, again", honest)):
            rows.append((label, run_child(snapshot, Path(args.package), limit)))
        print(f"package: {args.package}")
        print(
            f"hostile: world size 10^9 (4 rank files), grad_info_rank0.pt {bomb / 2**20:.1f} MiB deflating to "
            f"{args.bomb_gib:g} GiB, grad_info_rank1.pt declaring 3 GiB, .metadata declaring a 10^6 x 10^6 tensor"
        )
        print(f"{'snapshot':<16} {'seconds':>9} {'peak RSS MiB':>13}  outcome")
        for label, r in rows:
            outcome = (
                r.get("failed") or f"{r['ranks']} rank rows, {r['problems']} problems (longest {r['longest']} chars)"
            )
            print(f"{label:<16} {r['seconds']:>9.3f} {r['peak_rss_kib'] / 1024:>13.0f}  {outcome}")
        honest_rss = min(rows[0][1]["peak_rss_kib"], rows[2][1]["peak_rss_kib"])
        honest_s = min(rows[0][1]["seconds"], rows[2][1]["seconds"])
        hostile_r = rows[1][1]
        memory = hostile_r["peak_rss_kib"] / honest_rss if "failed" not in hostile_r else float("inf")
        print(f"peak memory hostile / honest: {memory:.2f}x (target <= 1.5x)")
        print(f"time hostile / honest: {hostile_r['seconds'] / honest_s:.2f}x")
        ratios = [memory, *surface_ratios(args)]
        return 0 if max(ratios) <= 1.5 else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def surface_ratios(args: argparse.Namespace) -> list[float]:
    """Measure and print the other surfaces' hostile classes; their peak-memory ratios hostile / honest."""
    package, chosen, timeout_s = Path(args.package), set(args.surfaces.split(",")), args.surface_timeout
    ratios = []
    if "line" in chosen:
        rows = output_line_rows(package, args.line_mb, timeout_s)
        ratios.append(print_rows("command output through the job pump (the session's process):", rows, "outcome"))
    if "frame" in chosen:
        rows = warm_frame_rows(package, args.frame_mib, timeout_s)
        ratios.append(print_rows("warm service reading one message (the service's process):", rows, "outcome"))
    if "logs" in chosen:
        rows = logs_dir_rows(package, args.log_files, timeout_s)
        ratios.append(print_rows("logs DIR (the logs process):", rows, "outcome"))
    return ratios


if __name__ == "__main__":
    raise SystemExit(main())
