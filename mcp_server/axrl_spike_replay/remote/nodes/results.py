"""Replay results of remote and command-backend runs: snapshot facts, judged and failed results, log tails."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.experiment.run_dir import now_iso
from axrl_spike_replay.experiment.verdict import baseline_verdict, mitigation_verdict, ratio_threshold, rel_diff
from axrl_spike_replay.snapshot.metadata import AxrlMetadata, read_metadata
from axrl_spike_replay.vocabulary import Backend, Fidelity, Verdict


@dataclass(frozen=True)
class SnapshotFacts:
    """What a remote run needs to know about a snapshot, read locally (the storage is shared)."""

    snapshot: str  # absolute path, the same on the node
    meta: AxrlMetadata
    legacy: bool

    @property
    def world_size(self) -> int:
        return int(self.meta.parallel.world_size)

    @property
    def threshold(self) -> float:
        return ratio_threshold(self.meta.detector)

    @property
    def job(self) -> str:
        return self.meta.job_name or "spike"


def snapshot_facts(snapshot: str | Path) -> SnapshotFacts:
    """Read a snapshot's metadata; SnapshotError names the file when it is not a snapshot."""
    path = Path(snapshot).expanduser().resolve()
    meta, legacy = read_metadata(path)
    return SnapshotFacts(snapshot=str(path), meta=meta, legacy=legacy)


def base_result(facts: SnapshotFacts, **fields: Any) -> ReplayResult:
    """A ReplayResult with the snapshot's facts filled in; `fields` set the rest."""
    meta = facts.meta
    values: dict[str, Any] = {
        "snapshot": facts.snapshot,
        "backend": Backend.TORCH,
        "target": "local",
        "fidelity": Fidelity.FULL,
        "world_size_saved": facts.world_size,
        "world_size_used": facts.world_size,
        "mitigations": {},
        "grad_norm": None,
        "recorded_grad_norm": meta.grad_norm,
        "rel_diff": None,
        "median_norm": meta.median_norm,
        "spike_ratio": None,
        "verdict": Verdict.FAILED,
        "threshold": facts.threshold,
        "job_name": meta.job_name,
        "role": meta.role,
        "iteration": meta.iteration,
        "created_at": now_iso(),
        "legacy_layout": facts.legacy,
    }
    values.update(fields)
    return ReplayResult(**values)


def judged_result(
    facts: SnapshotFacts,
    grad_norm: float,
    tolerance: float,
    changed: bool,
    baseline: float | None = None,
    **fields: Any,
) -> ReplayResult:
    """A finished run's result: a baseline is judged against the recorded norm; a changed run (patch,
    mitigation) as a mitigation, against `baseline` (the baseline replayed the same way) when given, else
    against the recorded norm as its baseline (what training saw)."""
    meta = facts.meta
    ratio = grad_norm / meta.median_norm if meta.median_norm > 0 and math.isfinite(grad_norm) else None
    if changed:
        base = meta.grad_norm if baseline is None else baseline
        verdict = mitigation_verdict(grad_norm, base, meta.median_norm, facts.threshold)
        extra: dict[str, Any] = {
            "baseline_grad_norm": base,
            "change_vs_baseline": grad_norm / base - 1.0 if base and math.isfinite(base) else None,
        }
    else:
        verdict, extra = baseline_verdict(grad_norm, meta.grad_norm, tolerance), {}
    return base_result(
        facts,
        grad_norm=grad_norm,
        rel_diff=rel_diff(grad_norm, meta.grad_norm),
        spike_ratio=ratio,
        verdict=verdict,
        tolerance=tolerance,
        **extra,
        **fields,
    )


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file ('' when missing)."""
    if not path.is_file():
        return ""
    text = path.read_text(encoding="utf-8", errors="replace").rstrip("\n").splitlines()
    return "\n".join(text[-lines:])
