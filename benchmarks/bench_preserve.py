"""Benchmark: `preserve` of a >= 2 GB snapshot vs `shutil.copytree` of the same snapshot, side by side.

Disk use is counted over unique inodes (st_blocks), so hardlinked files count once, as `du` does.
Targets: >= 100x faster, and no data bytes copied on the same filesystem.

    .venv/bin/python benchmarks/bench_preserve.py [--gib 2.25] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from axrl_spike_replay.snapshot.layout import PRESERVED_DIR
from axrl_spike_replay.snapshot.preservation.preserve import preserve
from big_snapshot import GIB, make_in_child, snapshot_bytes


def disk_bytes(root: Path) -> int:
    """Bytes allocated on disk below `root`, each inode counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.25, help="snapshot size in GiB (default 2.25)")
    parser.add_argument("--dir", default=None, help="where to write the snapshot (default: a temp dir)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="axrl-bench-preserve-", dir=args.dir))
    try:
        print(f"writing a {args.gib:.2f} GiB snapshot under {workdir} ...", file=sys.stderr, flush=True)
        snapshot = make_in_child(workdir, args.gib)
        output_dir = snapshot.parents[2]
        size = snapshot_bytes(snapshot)
        before = disk_bytes(workdir)

        t0 = time.perf_counter()
        result = preserve(output_dir, 100)
        preserve_s = time.perf_counter() - t0
        after_preserve = disk_bytes(workdir)
        (copy,) = result.preserved
        preserved = Path(copy.path)
        links = sorted({(p.stat().st_nlink) for p in preserved.rglob("*") if p.is_file() and p.name.endswith(".pt")})

        t0 = time.perf_counter()
        shutil.copytree(snapshot, workdir / "copytree-copy")
        copytree_s = time.perf_counter() - t0
        after_copytree = disk_bytes(workdir)

        preserve_added = after_preserve - before
        copytree_added = after_copytree - after_preserve
        speedup = copytree_s / preserve_s
        print(f"snapshot: {size / GIB:.2f} GiB, {sum(1 for p in snapshot.rglob('*') if p.is_file())} files")
        print(f"{'way':<34} {'seconds':>9} {'disk added':>14}")
        print(f"{'shutil.copytree':<34} {copytree_s:>9.3f} {copytree_added / GIB:>10.2f} GiB")
        print(f"{'preserve (hardlinks)':<34} {preserve_s:>9.4f} {preserve_added / 1024:>10.1f} KiB")
        print(f"preserve: {copy.linked_files} files hardlinked, {copy.copied_files} copied; .pt link counts {links}")
        print(f"preserved copy at {PRESERVED_DIR}/{preserved.name}; the only new bytes are its marker file")
        print(f"speedup: {speedup:.0f}x (target >= 100x)")
        ok = speedup >= 100 and copy.copied_files == 0 and preserve_added < 64 * 1024
        return 0 if ok else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
