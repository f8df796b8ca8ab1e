"""Every case of the held-out provenances a figure is taken on (`unseen`, `held_out_iii`, `held_out_iv`,
`held_out_v`, `held_out_vi`, `held_out_vii`, `held_out_viii`, `held_out_ix`, `held_out_x`) spikes at its burst in a
genuine reference-trainer run on its own model and world size: a case that stops spiking leaves the accuracy
(`bench_diagnosis` lists it as `no spike`) without anyone noticing, as two `unseen` cases once did when the trainer's
head and loss changed."""

from __future__ import annotations

import pytest

from axrl_spike_replay.testing.fault_matrix import MatrixCase, burst_snapshots, capture_case, matrix_cases

CASES = matrix_cases(
    (
        "unseen",
        "held_out_iii",
        "held_out_iv",
        "held_out_v",
        "held_out_vi",
        "held_out_vii",
        "held_out_viii",
        "held_out_ix",
        "held_out_x",
    )
)


@pytest.mark.matrix
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_held_out_case_spikes_at_its_burst(case: MatrixCase, tmp_path) -> None:
    run = capture_case(case, tmp_path, model=case.model or "tiny_moe")
    assert burst_snapshots(run, case.preset), f"{case.name}: no spike at the burst (grad norms {run.grad_norms})"
