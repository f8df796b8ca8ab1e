"""Figures and builders the investigation-record tests share: replay results with real figures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.experiment.result import ReplayResult

JOB = "fixture-moe"
ITERATION = 5
RECORDED = 37.42  # grad norm the trainer saw at the spike step
MEDIAN = 2.91  # median of the detector window
THRESHOLD = 5.0


@dataclass
class SpikeRun:
    output_dir: Path
    snapshot: Path
    iteration: int


def replay_result(snapshot: Path, grad_norm: float | None, verdict: str, **changes: object) -> ReplayResult:
    """A replay result with the figures a replay of the spike snapshot reports."""
    doc = {
        "snapshot": str(snapshot),
        "backend": "torch",
        "target": "local",
        "fidelity": "full",
        "world_size_saved": 2,
        "world_size_used": 2,
        "mitigations": {},
        "grad_norm": grad_norm,
        "recorded_grad_norm": RECORDED,
        "rel_diff": None if grad_norm is None else abs(grad_norm - RECORDED) / RECORDED,
        "median_norm": MEDIAN,
        "spike_ratio": None if grad_norm is None else grad_norm / MEDIAN,
        "verdict": verdict,
        "threshold": THRESHOLD,
        "job_name": JOB,
        "role": "actor",
        "iteration": ITERATION,
        "created_at": "2026-01-01T00:00:00+00:00",
    }
    doc.update(changes)
    return ReplayResult(**doc)


def save_result(workspace: Path, name: str, result: ReplayResult) -> Path:
    """Write `tmp/spike-replay/<job>/<name>/replay_result.json` as a replay does."""
    path = workspace / "tmp" / "spike-replay" / JOB / name / "replay_result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2))
    return path
