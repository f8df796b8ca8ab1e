"""Two more hostile classes of snapshot files, beside the honest case of the same size, each in a fresh process
importing the package under test (see bench_hostile.py):

- bytes entries: `check_checkpoint_storage` (what inspect and both replay routes run before a load) of a DCP
  checkpoint holding `entries` bytes entries as Megatron writes its `_extra_state`s, each a distinct small tensor as
  Transformer Engine's are (so no two are judged once for both), vs the same checkpoint whose last entry is a pickle
  that would run code (refused by name; nothing runs);
- links: `inspect` of a synthetic snapshot of `ranks` ranks, vs the same snapshot whose run config and every rank
  file is a symlink to an honest copy outside it (each refused by name, none read).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from hostile_snapshot import save_bytes_entries, torch_saved
from hostile_surfaces import _child

BYTES_CHECK = """
import json, sys, time
import torch  # imported before the clock starts, as in bench_hostile's children
from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage
t0 = time.perf_counter()
problems = check_checkpoint_storage(sys.argv[1])
t = time.perf_counter() - t0
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"seconds": t, "peak_rss_kib": hwm, "problems": len(problems),
                  "first": problems[0][-90:] if problems else None, "ran": __import__("os").path.exists(sys.argv[2])}))
"""

INSPECT = """
import json, sys, time
import torch
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
t0 = time.perf_counter()
result = inspect_snapshot(sys.argv[1])
t = time.perf_counter() - t0
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"seconds": t, "peak_rss_kib": hwm, "problems": len(result.problems)}))
"""


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _bytes_checkpoint(directory: Path, entries: int, marker: Path | None = None) -> None:
    """A DCP checkpoint of `entries` bytes entries, each `[uint8 tensor]` of its own values; with `marker`, the last
    one a pickle that writes `marker` when unpickled."""
    import torch

    objects = {
        f"decoder.layers.mlp.experts.linear_fc1._extra_state/shard_0.{i}_1.{entries}": torch_saved(
            [torch.tensor(list(i.to_bytes(4, "little")) * 4, dtype=torch.uint8)]
        )
        for i in range(entries)
    }
    if marker is not None:
        objects[max(objects)] = torch_saved([_RunsCode(marker)])
    save_bytes_entries(directory, objects)


def bytes_entry_rows(package: Path, entries: int, timeout_s: float) -> list[tuple[str, dict[str, Any]]]:
    """The bytes-entry check of an honest checkpoint of `entries` extra states, then of one whose last would run."""
    root = Path(tempfile.mkdtemp(prefix="axrl-bench-bytes-"))
    try:
        honest, hostile, marker = root / "honest", root / "hostile", root / "code-ran"
        _bytes_checkpoint(honest, entries)
        _bytes_checkpoint(hostile, entries, marker)
        return [
            (f"{entries} extra states", _child(BYTES_CHECK, [str(honest), str(marker)], package, timeout_s)),
            ("last one runs code", _child(BYTES_CHECK, [str(hostile), str(marker)], package, timeout_s)),
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def link_rows(package: Path, ranks: int, timeout_s: float) -> list[tuple[str, dict[str, Any]]]:
    """`inspect` of a `ranks`-rank snapshot, then of the same whose run config and rank files link out of it."""
    from axrl_spike_replay.snapshot.layout import RUN_CONFIG, SNAPSHOTS_DIR, rank_files
    from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot

    root = Path(tempfile.mkdtemp(prefix="axrl-bench-links-"))
    try:
        spec = SyntheticSpec(iteration=7, world_size=ranks, batch_size=8, seq_len=256, prompt_len=64)
        honest = write_synthetic_snapshot(root / "honest~bench__actor" / SNAPSHOTS_DIR, spec)
        linked = root / "linked~bench__actor" / SNAPSHOTS_DIR / honest.name
        shutil.copytree(honest, linked)
        outside = root / "outside"
        outside.mkdir()
        names = [RUN_CONFIG] + [p.name for files in rank_files(linked).values() for p in files.values()]
        for name in names:
            shutil.move(linked / name, outside / name)
            (linked / name).symlink_to(outside / name)
        return [
            (f"{ranks} ranks, honest", _child(INSPECT, [str(honest)], package, timeout_s)),
            (f"{len(names)} files linked out", _child(INSPECT, [str(linked)], package, timeout_s)),
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
