"""The training log's view of a snapshot's iteration: which logs belong to the job, and the logged grad norm,
loss and neighbourhood there. Read in place (no copy), streaming, with the same line reader as `logs`.

Lives beside the snapshot code because `inspect` and the baseline replay check a snapshot against its log.
The line reader it uses (`logs/`) sits below the snapshot layer, on the ground modules alone
(tests/replay/test_layering.py holds it there).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.discovery import find_logs
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, SNAPSHOTS_DIR, WORKSPACE_PRESERVED

# Logs found next to a snapshot are read on every `inspect` / `replay`: above this much, skip and say so.
AUTO_LOG_BYTES = 256 * 1024 * 1024
NEIGHBOURHOOD = 10  # iterations before the spike whose norms describe the run's normal level


@dataclass
class LogPoint:
    """What the job's log says at one iteration (`grad_norm` None when the log lacks it), and why if nothing."""

    iteration: int
    grad_norm: float | None = None
    loss: float | None = None
    source: str | None = None  # the log file(s) read
    before: list[float] = field(default_factory=list)  # grad norms of the NEIGHBOURHOOD iterations before
    error_lines: int = 0
    note: str = ""


def job_logs(snapshot_dir: str | Path) -> list[Path]:
    """The logs of the job output dir a snapshot sits in (`<out>/checkpoints/spike_snapshots[-active]/iter_N`), or,
    for a copy `preserve` made in a workspace (`<workspace>/preserved-snapshots/<out name>/iter_N`), of the output
    dir its marker names as its source; none when the snapshot is in neither place."""
    directory = Path(snapshot_dir).absolute()
    container = directory.parent
    for layout_dir in (SNAPSHOTS_DIR, PRESERVED_DIR):
        depth = len(layout_dir.parts)
        if container.parts[-depth:] == layout_dir.parts:
            return find_logs(container.parents[depth - 1])
    if container.parent.name == WORKSPACE_PRESERVED.name:
        return _source_logs(directory)
    return []


def _source_logs(copy: Path) -> list[Path]:
    """The job logs of the snapshot a workspace copy was made from (its marker's `source`, read as untrusted)."""
    from axrl_spike_replay.snapshot.preservation.preserved_marker import read_marker

    marker, _ = read_marker(copy)
    source = str(marker.get("source") or "") if marker else ""
    if not source:
        return []
    origin = Path(source)
    for layout_dir in (SNAPSHOTS_DIR, PRESERVED_DIR):
        depth = len(layout_dir.parts)
        if origin.parent.parts[-depth:] == layout_dir.parts:
            output_dir = origin.parent.parents[depth - 1]
            return find_logs(output_dir) if output_dir.is_dir() else []
    return []


def log_point(
    snapshot_dir: str | Path, iteration: int, logs: Sequence[str | Path] | None = None, *, limit: int | None = None
) -> LogPoint:
    """The logged grad norm and loss at `iteration` from `logs` (default: the snapshot's job logs, skipped when
    over `limit` bytes, default AUTO_LOG_BYTES). Never raises for an unreadable log: `note` says what happened."""
    paths = [Path(p) for p in logs] if logs is not None else job_logs(snapshot_dir)
    point = LogPoint(iteration)
    if not paths:
        point.note = "no job logs known (give the logs, or keep the snapshot in its job output dir)"
        return point
    files = [p for p in paths if p.is_file()]
    if logs is None:
        size = sum(p.stat().st_size for p in files)
        if size > (AUTO_LOG_BYTES if limit is None else limit):
            point.note = f"job logs are {size / 2**20:.0f} MiB: not read here (give them to `diagnose --logs`)"
            return point
    from axrl_spike_replay.logs.log_reader import LogTally, scan_file  # numpy, imported only when there are logs

    tally = LogTally()
    try:
        for path in files:
            scan_file(path, tally)
    except (OSError, AxrlError) as exc:
        point.note = f"could not read the logs ({exc})"
        return point
    point.source = ", ".join(str(p) for p in files)
    point.error_lines = tally.error_lines
    series, _ = tally.series.settled()  # in iteration order, the last logged value of an iteration winning
    lo = bisect.bisect_left(series.iterations, iteration - NEIGHBOURHOOD)
    hi = bisect.bisect_right(series.iterations, iteration)
    window = {p["iteration"]: p for p in series[lo:hi]}
    point.before = [
        float(p["grad_norm"])
        for i in range(iteration - NEIGHBOURHOOD, iteration)
        if (p := window.get(i)) is not None and p.get("grad_norm") is not None
    ]
    found = window.get(iteration)
    if found is None or found.get("grad_norm") is None:
        point.note = f"the logs have no grad norm at iteration {iteration}"
        return point
    point.grad_norm = float(found["grad_norm"])
    loss = found.get("loss")
    point.loss = float(loss) if loss is not None and math.isfinite(float(loss)) else None
    return point


def as_json(point: LogPoint) -> dict[str, Any]:
    """The point as a plain dict."""
    return asdict(point)
