"""A fault-matrix case captured and diagnosed as the benchmark diagnoses it, for the rule tests (shared helper, not a
test)."""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.diagnosis.diagnose import Diagnosis, diagnose_snapshot
from axrl_spike_replay.testing.fault_matrix import MatrixCase, burst_snapshots, capture_case


def diagnosed_case(case: MatrixCase, out: Path) -> Diagnosis:
    """`diagnose_snapshot(model="auto")` of the burst's largest spike of `case` captured under `out`."""
    run = capture_case(case, out, model=case.model or "tiny_moe")
    snapshots = burst_snapshots(run, case.preset)
    assert snapshots, f"no spike at the burst: {run.grad_norms}"
    return diagnose_snapshot(snapshots[0], model="auto")
