"""Benchmark: `inspect` of a >= 2 GB snapshot vs a plain full `torch.load` of every file, side by side.

Each way runs in its own fresh Python process (plus a bare `import torch` process as the memory
baseline); each child reports its wall time for the operation and its peak RSS (VmHWM). Both
read the same files from the page cache (the naive way at its fastest). Targets: >= 100x faster,
peak memory within 1.5x of the bare `import torch` process.

    .venv/bin/python benchmarks/bench_inspect.py [--gib 2.25] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from big_snapshot import GIB, make_in_child, snapshot_bytes

# Peak RSS is the process's VmHWM: per address space, so (unlike ru_maxrss, which Linux carries across
# exec) it is not inherited from the parent that started the child.
_REPORT = """
import json
hwm = [int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:')][0]
print(json.dumps({'seconds': t, 'peak_rss_kib': hwm, **extra}))
"""

BARE = "import torch; t = 0.0; extra = {}\n" + _REPORT

# imports first (a fixed per-process cost, like `import torch`), then the timed call
INSPECT = (
    """
import sys, time, torch
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
t0 = time.perf_counter()
result = inspect_snapshot(sys.argv[1])
t = time.perf_counter() - t0
t1 = time.perf_counter(); inspect_snapshot(sys.argv[1]); again = time.perf_counter() - t1
extra = {"problems": result.problems, "loss_tokens": sum(r.num_loss_tokens for r in result.ranks), "again": again}
"""
    + _REPORT
)

# what the `inspect` faces run: the above plus every rank's routes, tokens, masks and stored log-probs held to the
# run config's model (replay.reading.input_checks: values of those tensors read, no weight loaded)
WITH_INPUTS = (
    """
import sys, time, torch
from axrl_spike_replay.replay.reading.input_checks import inspect_with_inputs
t0 = time.perf_counter()
result = inspect_with_inputs(sys.argv[1])
t = time.perf_counter() - t0
extra = {"problems": result.problems}
"""
    + _REPORT
)

INSPECT_COLD = (
    """
import sys, time, torch
t0 = time.perf_counter()
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
inspect_snapshot(sys.argv[1])
t = time.perf_counter() - t0
extra = {}
"""
    + _REPORT
)

NAIVE = (
    """
import sys, time, torch
from pathlib import Path
files = sorted(Path(sys.argv[1]).glob("*.pt"))
t0 = time.perf_counter()
loaded = [torch.load(f, weights_only=True) for f in files]
t = time.perf_counter() - t0
extra = {"files": len(files)}
"""
    + _REPORT
)


def run_child(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter; return the JSON it prints."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.25, help="snapshot size in GiB (default 2.25)")
    parser.add_argument("--dir", default=None, help="where to write the snapshot (default: a temp dir)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="axrl-bench-inspect-", dir=args.dir))
    try:
        print(f"writing a {args.gib:.2f} GiB snapshot under {workdir} ...", file=sys.stderr, flush=True)
        snapshot = make_in_child(workdir, args.gib)
        size = snapshot_bytes(snapshot)
        bare = run_child(BARE)
        naive = run_child(NAIVE, str(snapshot))  # also warms the page cache for both ways
        ours = run_child(INSPECT, str(snapshot))
        cold = run_child(INSPECT_COLD, str(snapshot))
        inputs = run_child(WITH_INPUTS, str(snapshot))
        if ours["problems"]:
            raise SystemExit(f"inspect reported problems: {ours['problems']}")
        speedup = naive["seconds"] / ours["seconds"]
        cold_speedup = naive["seconds"] / cold["seconds"]
        memory = ours["peak_rss_kib"] / bare["peak_rss_kib"]
        print(f"snapshot: {size / GIB:.2f} GiB in {naive['files']} .pt files + checkpoint")
        print(f"{'way':<44} {'seconds':>9} {'peak RSS MiB':>13}")
        print(f"{'bare `import torch` process':<44} {'-':>9} {bare['peak_rss_kib'] / 1024:>13.0f}")
        print(f"{'naive: torch.load every file':<44} {naive['seconds']:>9.3f} {naive['peak_rss_kib'] / 1024:>13.0f}")
        print(
            f"{'inspect_snapshot (modules imported)':<44} {ours['seconds']:>9.4f} {ours['peak_rss_kib'] / 1024:>13.0f}"
        )
        print(f"{'inspect_snapshot, second call':<44} {ours['again']:>9.4f} {'':>13}")
        cold_rss = cold["peak_rss_kib"] / 1024
        print(f"{'inspect_snapshot incl. its lazy imports':<44} {cold['seconds']:>9.4f} {cold_rss:>13.0f}")
        inputs_rss = inputs["peak_rss_kib"] / 1024
        print(f"{'inspect with input checks (the faces)':<44} {inputs['seconds']:>9.4f} {inputs_rss:>13.0f}")
        print(f"speedup: {speedup:.0f}x (target >= 100x)")
        print(
            f"with the input checks: {naive['seconds'] / inputs['seconds']:.0f}x, peak memory "
            f"{inputs['peak_rss_kib'] / bare['peak_rss_kib']:.2f}x bare (problems: {len(inputs['problems'])})"
        )
        print(
            f"including inspect's own lazy imports (paid once per process): {cold_speedup:.0f}x at this size; "
            "it grows with the snapshot, the imports do not"
        )
        print(f"peak memory vs bare import torch: {memory:.2f}x (target <= 1.5x)")
        return 0 if speedup >= 100 and memory <= 1.5 else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
