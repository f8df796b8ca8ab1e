"""Every case of the held-out provenances a figure is taken on (`unseen`, and `held_out_iii` and every set after it)
spikes at its burst in a genuine reference-trainer run on its own model and world size: a case that stops spiking
leaves the accuracy (`bench_diagnosis` lists it as `no spike`) without anyone noticing, as two `unseen` cases once did
when the trainer's head and loss changed."""

from __future__ import annotations

import pytest

from axrl_spike_replay.testing.fault_matrix import (
    PROVENANCES,
    MatrixCase,
    burst_snapshots,
    capture_case,
    matrix_cases,
)

# every set from the third on names its model and world size per case (and any set added later: the last in order)
CASES = matrix_cases(("unseen", *PROVENANCES[PROVENANCES.index("held_out_iii") :]))


@pytest.mark.matrix
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_held_out_case_spikes_at_its_burst(case: MatrixCase, tmp_path) -> None:
    run = capture_case(case, tmp_path, model=case.model or "tiny_moe")
    assert burst_snapshots(run, case.preset), f"{case.name}: no spike at the burst (grad norms {run.grad_norms})"
