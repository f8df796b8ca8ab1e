"""Benchmark: reading verbs on snapshots whose files declare huge sizes vs the same snapshots honest, side by side.

`inspect`: the hostile copy of a synthetic snapshot declares a world size of 10^9 in its metadata, holds a grad
info whose tensor is a zip bomb (a few MB deflating to --bomb-gib GiB), one whose pickle declares a 3 GiB tensor
over 4 MiB of data, a checkpoint `.metadata` declaring a 10^6 x 10^6 tensor, and a `.distcp` entry that is a zip
bomb (the tensor's own values over a storage deflating to --bomb-gib GiB).

`replay` and `diagnose`: the golden fixture snapshot (a real capture, replayable) vs a copy whose embedding's
`.distcp` entry is that zip bomb: DCP's reader would inflate it whole and then load the right values, so a replay
that does not check the entries reproduces the spike at the cost of the inflated storage.

Each verb runs in its own fresh Python process (limited to --limit-gib of address space, so an unbounded reader
fails instead of swapping a shared machine) and reports its wall time and peak RSS (VmHWM). Target: a hostile
snapshot costs at most 1.5x the honest one in peak memory, for every verb.

`inspect` and `replay` on a chunk table: the golden fixture whose `.metadata` declares --chunks chunks of the
embedding, all pointing at the embedding's one `.distcp` entry (refused: chunks that overlap, entries that share
bytes; each entry is checked once).

Then the worst case of each hostile class on the other surfaces, beside the honest case of the same size
(`hostile_surfaces.py`, `hostile_reads.py`, `hostile_inputs.py`): a 100 MB output line without a newline from the
command backend's job, a 64 MiB warm-service frame, a logs dir of 16k files, a checkpoint of 20k Megatron extra
states (bytes entries) whose last would run code, a snapshot whose run config and rank files all link out of it, a
1 MiB MCP stdio line nested as deep as it is long, a 1 MiB `capture --fault` spec nested as deep (and one of escaped
quotes), the skill eval scorer on 20,000 blank lines. Same target for each: at most 1.5x the honest case's peak memory.

    .venv/bin/python benchmarks/bench_hostile.py [--bomb-gib 3] [--chunks 65536] [--package DIR] [--dir DIR]
        [--surfaces line,frame,logs,bytes,links,stdio,fault,scorer|none] [--line-mb 100] [--frame-mib 64]
        [--log-files 16000] [--bytes-entries 20000] [--link-ranks 64] [--stdio-kib 1024] [--fault-kib 1024]
        [--report-lines 20000] [--surfaces-only]

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
from hostile_inputs import fault_spec_rows, scorer_rows, stdio_line_rows  # noqa: E402
from hostile_reads import bytes_entry_rows, link_rows  # noqa: E402
from hostile_snapshot import (  # noqa: E402
    declare_checkpoint_tensor,
    declare_world_size,
    set_checkpoint_chunks,
    write_compressed_tensor_file,
    write_distcp_bomb,
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


# replay (one process, in the child) or diagnose (model evidence: the attribution replay) of a snapshot
RUN = """
import json, os, resource, sys, time
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
os.chdir(sys.argv[4])  # a workspace of its own: nothing is written into the checkout
import torch
t0 = time.perf_counter()
try:
    if sys.argv[3] == "replay":
        from axrl_spike_replay.investigation.request import How, What, replay_request
        from axrl_spike_replay.replay.engine import run_replay
        r = run_replay(replay_request(What(sys.argv[1]), how=How(nproc=1)))
        outcome = {"outcome": f"{r.verdict}, grad norm {r.grad_norm:.6g}"}
    else:
        from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
        d = diagnose_snapshot(sys.argv[1], model="always")
        left = [n for n in d.not_checked if n.startswith("model evidence")]
        outcome = {"outcome": left[0] if left else f"attribution replayed, top cause {d.causes[0].family}"}
except BaseException as exc:
    outcome = {"failed": f"{type(exc).__name__}: {str(exc)}"}
t = time.perf_counter() - t0
hwm = [int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:')][0]
print(json.dumps({'seconds': t, 'peak_rss_kib': hwm, **outcome}))
"""


def run_child(snapshot: Path, package: Path, limit: int, verb: str = "inspect") -> dict:
    """Run `verb` on `snapshot` in a fresh interpreter importing the package under `package`; its JSON report."""
    env = {**os.environ, "PYTHONPATH": str(package)}
    if verb == "inspect":
        argv = [sys.executable, "-c", INSPECT, str(snapshot), str(limit)]
    else:
        workspace = tempfile.mkdtemp(prefix="axrl-bench-hostile-ws-")
        argv = [sys.executable, "-c", RUN, str(snapshot), str(limit), verb, workspace]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    finally:
        if verb != "inspect":
            shutil.rmtree(workspace, ignore_errors=True)
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
    write_distcp_bomb(hostile, int(bomb_gib * GIB), name="model.head.weight")
    return honest, hostile


def make_replayable_pair(workdir: Path, bomb_gib: float) -> tuple[Path, Path, int]:
    """(honest, hostile, entry bytes): copies of the golden fixture job, the hostile one's embedding entry a bomb."""
    job = REPO / "tests" / "fixtures" / "outputs" / "fx~fixture-moe__actor"
    pair = []
    for label in ("honest", "bomb"):
        out = workdir / label / job.name
        shutil.copytree(job, out)
        pair.append(out / SNAPSHOTS_DIR / "iter_0000021")
    size = write_distcp_bomb(pair[1], int(bomb_gib * GIB))
    return pair[0], pair[1], size


def make_chunk_table_pair(workdir: Path, chunks: int) -> tuple[Path, Path]:
    """(honest, hostile): copies of the golden fixture job, the hostile one's `.metadata` declaring `chunks` chunks
    of one embedding row each, every one pointing at the embedding's one entry (the worst chunk table: each chunk
    names the same bytes, so a reader that checks entry by entry inflates the same entry `chunks` times)."""
    import pickle

    job = REPO / "tests" / "fixtures" / "outputs" / "fx~fixture-moe__actor"
    pair = []
    for label in ("honest", "chunks"):
        out = workdir / f"table-{label}" / job.name
        shutil.copytree(job, out)
        pair.append(out / SNAPSHOTS_DIR / "iter_0000021")
    name = "model.embed.weight"
    rows, cols = pickle.loads((pair[1] / ".metadata").read_bytes()).state_dict_metadata[name].size
    set_checkpoint_chunks(pair[1], name, [((i % rows, 0), (1, cols)) for i in range(chunks)])
    return pair[0], pair[1]


def _outcome(r: dict) -> str:
    text = r.get("failed") or r.get("outcome")
    if text:
        return text if len(text) <= 150 else "…" + text[-150:]  # a refusal's reason comes after its file name
    return f"{r['ranks']} rank rows, {r['problems']} problems (longest {r['longest']} chars)"


def _table(rows: list[tuple[str, dict]]) -> None:
    print(f"{'snapshot':<22} {'seconds':>9} {'peak RSS MiB':>13}  outcome")
    for label, r in rows:
        print(f"{label:<22} {r['seconds']:>9.3f} {r['peak_rss_kib'] / 1024:>13.0f}  {_outcome(r)}")


def _ratio(label: str, honest: dict, hostile: dict) -> float:
    measured = hostile["peak_rss_kib"] and honest["peak_rss_kib"]  # 0: the child died before it could report
    memory = hostile["peak_rss_kib"] / honest["peak_rss_kib"] if measured else float("inf")
    print(
        f"{label}: peak memory hostile / honest {memory:.2f}x (target <= 1.5x), "
        f"time {hostile['seconds'] / honest['seconds']:.2f}x"
    )
    return memory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bomb-gib", type=float, default=3.0, help="what the zip-bomb grad info expands to")
    parser.add_argument("--limit-gib", type=float, default=8.0, help="address-space limit of each child")
    parser.add_argument("--package", default=str(REPO / "mcp_server"), help="the mcp_server dir to measure")
    parser.add_argument("--dir", default=None, help="where to write the snapshots (default: a temp dir)")
    parser.add_argument("--chunks", type=int, default=65536, help="chunks the hostile chunk table declares")
    parser.add_argument(
        "--surfaces",
        default="line,frame,logs,bytes,links,stdio,fault,scorer",
        help="other hostile classes to measure, or none",
    )
    parser.add_argument("--line-mb", type=int, default=100, help="the output line without a newline, in MB")
    parser.add_argument("--frame-mib", type=int, default=64, help="the warm-service frame without a newline, in MiB")
    parser.add_argument("--log-files", type=int, default=16000, help="files in the hostile logs dir")
    parser.add_argument("--bytes-entries", type=int, default=20000, help="bytes entries (extra states) to check")
    parser.add_argument("--link-ranks", type=int, default=64, help="ranks of the snapshot whose files link out")
    parser.add_argument("--stdio-kib", type=int, default=1024, help="the MCP stdio request line, in KiB")
    parser.add_argument("--fault-kib", type=int, default=1024, help="the capture --fault spec, in KiB")
    parser.add_argument("--report-lines", type=int, default=20000, help="lines of the report the scorer reads")
    parser.add_argument("--surface-timeout", type=float, default=900.0, help="seconds for each of those cases")
    parser.add_argument("--surfaces-only", action="store_true", help="measure only the --surfaces, no snapshot")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="axrl-bench-hostile-", dir=args.dir))
    limit = int(args.limit_gib * GIB)
    try:
        if args.surfaces_only:
            print(f"package: {args.package}")
            worst = surface_ratios(args, workdir)
            return 0 if max(worst, default=0.0) <= 1.5 else 1
        honest, hostile = make_pair(workdir, args.bomb_gib)
        bomb = (hostile / "grad_info_rank0.pt").stat().st_size
        package = Path(args.package)
        rows = [
            (label, run_child(snap, package, limit))
            for label, snap in (("honest", honest), ("hostile", hostile), ("honest, again", honest))
        ]
        print(f"package: {args.package}")
        print(
            f"inspect. hostile: world size 10^9 (4 rank files), grad_info_rank0.pt {bomb / 2**20:.1f} MiB deflating "
            f"to {args.bomb_gib:g} GiB, grad_info_rank1.pt declaring 3 GiB, .metadata declaring a 10^6 x 10^6 "
            f"tensor, a .distcp entry deflating to {args.bomb_gib:g} GiB"
        )
        _table(rows)
        best = min((rows[0][1], rows[2][1]), key=lambda r: r["peak_rss_kib"])
        worst = [_ratio("inspect", best, rows[1][1])]
        replay_honest, replay_bomb, entry = make_replayable_pair(workdir, args.bomb_gib)
        print(
            f"\nreplay (1 process) and diagnose (model evidence). hostile: the golden fixture with its embedding's "
            f".distcp entry a {entry / 2**20:.1f} MiB zip bomb deflating to {args.bomb_gib:g} GiB"
        )
        for verb in ("replay", "diagnose"):
            pair = [
                (f"{verb}, {label}", run_child(snap, package, limit, verb))
                for label, snap in (("honest", replay_honest), ("bomb", replay_bomb))
            ]
            _table(pair)
            worst.append(_ratio(verb, pair[0][1], pair[1][1]))
        table_honest, table = make_chunk_table_pair(workdir, args.chunks)
        size = (table / ".metadata").stat().st_size
        print(
            f"\ninspect and replay. hostile: the golden fixture with a .metadata of {size / 2**20:.1f} MiB declaring "
            f"{args.chunks} chunks of the embedding, every one pointing at the embedding's one .distcp entry"
        )
        for verb in ("inspect", "replay"):
            pair = [
                (f"{verb}, {label}", run_child(snap, package, limit, verb))
                for label, snap in (("honest", table_honest), ("chunk table", table))
            ]
            _table(pair)
            worst.append(_ratio(f"{verb}, chunk table", pair[0][1], pair[1][1]))
        worst.extend(surface_ratios(args, workdir))
        return 0 if max(worst) <= 1.5 else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def surface_ratios(args: argparse.Namespace, workdir: Path) -> list[float]:
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
    if "bytes" in chosen:
        rows = bytes_entry_rows(package, args.bytes_entries, timeout_s)
        title = "checkpoint bytes entries, weights-only (check_checkpoint_storage; ran: the pickle's marker exists):"
        ratios.append(print_rows(title, rows, "outcome"))
    if "links" in chosen:
        rows = link_rows(package, args.link_ranks, timeout_s)
        ratios.append(print_rows("snapshot files linked out of it (inspect):", rows, "outcome"))
    if "stdio" in chosen:
        for rows in stdio_line_rows(package, args.stdio_kib, timeout_s):
            title = "MCP server over stdio reading one request line (the server's process):"
            ratios.append(print_rows(title, rows, "answer"))
    if "fault" in chosen:
        for rows in fault_spec_rows(package, args.fault_kib, workdir, timeout_s):
            ratios.append(
                print_rows("capture --fault, the spec checked before training (the CLI's process):", rows, "outcome")
            )
    if "scorer" in chosen:
        rows = scorer_rows(package, args.report_lines, workdir, timeout_s)
        ratios.append(print_rows("evals/score.py on one report (the scorer's process):", rows, "score"))
    return ratios


if __name__ == "__main__":
    raise SystemExit(main())
