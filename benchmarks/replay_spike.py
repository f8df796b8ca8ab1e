"""A spike captured the way the demo captures one, for the replay benchmarks (shared helper, not a benchmark)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def capture_demo_spike(root: Path, preset: str = "ratio_outliers") -> Path:
    """The demo's reference run (world size 2, 32 steps, default batch: 2 prompts x 4 samples per rank);
    its worst spike snapshot."""
    from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
    from axrl_spike_replay.snapshot.metadata import read_metadata

    run = capture_reference_run(root / "outputs", job="bench-spike", world_size=2, steps=32, preset=preset)
    if not run.snapshot_dirs:
        raise SystemExit(f"the {preset} run tripped no spike guard")
    return max(run.snapshot_dirs, key=lambda p: read_metadata(p)[0].spike_ratio)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median(values: list[float]) -> float:
    return statistics.median(values)
