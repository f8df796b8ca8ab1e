"""A multi-GB spike snapshot for benchmarks: the synthetic snapshot with large activation tensors per rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot

GIB = 1 << 30


def make_big_snapshot(workdir: Path, total_bytes: int = int(2.25 * GIB), world_size: int = 4) -> Path:
    """Write `<workdir>/run1~bench__actor/checkpoints/spike_snapshots/iter_0000100` of about `total_bytes`.

    Each rank's batch file carries a float32 `hidden_states` [8, 4096, D] tensor (what a trainer saving
    activations next to its batch writes), sized so the snapshot reaches `total_bytes`.
    """
    per_rank = total_bytes // world_size
    width = max(1, per_rank // (8 * 4096 * 4))
    spec = SyntheticSpec(
        iteration=100,
        world_size=world_size,
        batch_size=8,
        seq_len=512,
        prompt_len=128,
        job_name="bench",
        extra_tensors={"hidden_states": (8, 4096, width)},
    )
    return write_synthetic_snapshot(workdir / "run1~bench__actor" / SNAPSHOTS_DIR, spec)


def make_in_child(workdir: Path, gib: float) -> Path:
    """`make_big_snapshot` in a child process, so this process stays small (its children inherit nothing)."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); from big_snapshot import *; "
        "print(make_big_snapshot(Path(sys.argv[2]), int(float(sys.argv[3]) * GIB)))"
    )
    here = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", code, here, str(workdir), str(gib)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"writing the benchmark snapshot failed:\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def snapshot_bytes(snapshot: Path) -> int:
    """Apparent size of every file in the snapshot."""
    return sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())
