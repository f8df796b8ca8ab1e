"""A long run's log is scanned in memory that does not grow with its length beyond a few bytes per iteration,
and the compact series reads, samples and finds spikes exactly as the list of points did."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_log_scan_streaming import _SHAPES, _megatron, _reference, _scanned

import axrl_spike_replay
from axrl_spike_replay.capture.detectors import make_detector
from axrl_spike_replay.diagnosis.evidence.log_scan import _spikes, scan_logs
from axrl_spike_replay.logs import log_blocks
from axrl_spike_replay.logs.log_series import SeriesBuilder
from axrl_spike_replay.logs.series_sampling import sampled_series

# The child caps its own address space at what it holds after the imports plus `budget` MiB, then scans.
_SCAN_WITHIN_A_BUDGET = """
import json, resource, sys
from axrl_spike_replay.diagnosis.evidence.log_scan import scan_logs, with_sampled_series
size = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
budget = int(sys.argv[3]) * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + budget, size + budget))
scan = scan_logs([sys.argv[1]], sys.argv[2])
sampled = with_sampled_series(scan)
print(json.dumps({"total": scan.series_total, "spikes": [s["iteration"] for s in scan.spikes],
                  "sampled": len(sampled.series_points), "last": scan.series_points[-1]}))
"""


def test_a_long_run_scans_within_a_fixed_memory_budget(tmp_path: Path) -> None:
    """300 000 iterations: a dict per point held ~80 MB; the scan now fits in 40 MB over the imports."""
    log = tmp_path / "long.log"
    with log.open("w") as handle:
        for i in range(1, 300_001):
            grad = 30.0 if i % 100_000 == 0 else 1.0 + (i % 7) / 100
            handle.write(f"iteration {i}/ 300000 | lm loss: 1.5E+00 | grad norm: {grad:.3f} |\n")
            if i % 5000 == 0:
                handle.write("WARNING: slow dataloader\n")
    child = subprocess.run(
        [sys.executable, "-c", _SCAN_WITHIN_A_BUDGET, str(log), str(tmp_path / "copies"), "40"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(axrl_spike_replay.__file__).parents[1])},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    doc = json.loads(child.stdout)
    assert doc["total"] == 300_000 and doc["spikes"] == [100_000, 200_000, 300_000]
    assert doc["sampled"] <= 2200
    assert doc["last"] == {"iteration": 300_000, "grad_norm": 30.0, "loss": 1.5}


@pytest.mark.parametrize("shape", range(1, len(_SHAPES)))
def test_a_megatron_run_broken_by_any_other_line_reads_as_the_text_reading(
    tmp_path: Path, shape: int, monkeypatch
) -> None:
    """Blocks of plain Megatron lines with a few lines of one other shape among them: those lines are read
    apart from the block and the block's lines keep their numbers."""
    monkeypatch.setattr(log_blocks, "READ_BYTES", 8192)
    rng = random.Random(shape)
    log = tmp_path / "train.log"
    with log.open("w", encoding="utf-8", errors="surrogateescape", newline="") as handle:
        for i in range(1, 400):
            handle.write(_SHAPES[shape](i, rng) if i % 37 == 0 else _megatron(i, 25.0 if i == 200 else 1.0))
    assert _scanned(log, tmp_path / "copies") == _reference(log)


def test_key_value_and_megatron_logs_with_restarts_read_as_the_text_reading(tmp_path: Path) -> None:
    rng = random.Random(5)
    log = tmp_path / "mixed.log"
    lines = []
    for i in range(1, 3000):
        at = rng.randrange(1, i + 1) if rng.random() < 0.05 else i  # restarts re-log earlier iterations
        lines.append(
            rng.choice(
                [
                    _megatron(at, rng.choice([1.0, 1.1, 40.0])),
                    f"step:{at} - actor/grad_norm:{rng.random():.4f} - actor/pg_loss:0.4 - critic/vf_loss:0.2\n",
                    f"2025-01-01 INFO step={at} grad_norm={rng.random()} loss=0.5 lr=1e-6\n",
                ]
            )
        )
    log.write_text("".join(lines))
    scanned = _scanned(log, tmp_path / "copies")
    assert scanned == _reference(log) and scanned["repeated"] > 0


def _dict_series(logged: list[tuple[int, float | None, float | None]]) -> list[dict[str, Any]]:
    points: dict[int, dict[str, Any]] = {}
    for it, grad, loss in logged:
        points[it] = {"iteration": it, "grad_norm": grad, "loss": loss}
    return [points[i] for i in sorted(points)]


@pytest.mark.parametrize("seed", [1, 2])
def test_the_compact_series_settles_samples_and_trips_as_the_list_of_points(seed: int) -> None:
    rng = random.Random(seed)
    values = [1.0, 1.1, 0.9, 0.0, -0.0, 7.5, math.nan, math.inf, None]
    logged = []
    for i in range(20_000):
        it = rng.randrange(0, i + 1) if rng.random() < 0.1 else i
        if rng.random() < 0.001:
            it = rng.choice([2**63, -(2**70), 10**30])  # a step too large for int64 is still a step
        grad = rng.choice(values) if rng.random() < 0.05 else 1.0 + rng.random() / 10
        logged.append((it, grad, rng.choice([None, 0.5, math.nan])))
    builder = SeriesBuilder()
    for at in range(0, len(logged), 1000):  # by points and by runs of read points, as the reader appends
        run = logged[at : at + 1000]
        if all(g is not None and loss is not None for _, g, loss in run):
            builder.extend_read([p[0] for p in run], [p[1] for p in run], [p[2] for p in run])
        else:
            for point in run:
                builder.append(*point)
    compact, repeated = builder.settled()
    expected = _dict_series(logged)

    assert repr(list(compact)) == repr(expected) and repeated == len(logged) - len(expected)
    assert repr(compact[5:9]) == repr(expected[5:9]) and repr(compact[-1]) == repr(expected[-1])
    trips = _spikes(compact, make_detector("median_ratio", window=8, threshold=5.0, warmup=3))
    assert repr(trips) == repr(_spikes(expected, make_detector("median_ratio", window=8, threshold=5.0, warmup=3)))
    spikes = [s["iteration"] for s in trips]
    for limit in (50, 500, 2000):
        assert repr(sampled_series(compact, spikes, limit=limit)) == repr(sampled_series(expected, spikes, limit=limit))


def test_a_log_of_only_zero_or_missing_norms_has_no_sampled_extremes_to_lose(tmp_path: Path) -> None:
    log = tmp_path / "flat.log"
    log.write_text("".join(f"step={i} loss=0.{i % 9}\n" for i in range(1, 6001)))
    scan = scan_logs([log], tmp_path / "copies")
    assert scan.series_total == 6000 and scan.spikes == []
    kept = sampled_series(scan.series_points, [], limit=100)
    assert kept == sampled_series(list(scan.series_points), [], limit=100) and len(kept) <= 110
