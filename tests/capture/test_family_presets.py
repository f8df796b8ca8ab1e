"""Each cause family's preset plants its trainer bug during the burst and the burst spikes, on the tiny model and on
three transformers MoE architectures (the matrix; `pytest -m matrix` runs it)."""

from __future__ import annotations

import pytest
import torch

from axrl_spike_replay.capture.reference.presets import FAMILY_PRESETS
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.rank_data import load_rank_batch
from axrl_spike_replay.testing.fault_matrix import MatrixCase, burst_snapshots, capture_case, matrix_cases

ARCHITECTURES = ("tiny_moe", "qwen2_moe", "olmoe", "mixtral")
PRESET_CASES = matrix_cases(("preset",))


@pytest.mark.slow
def test_the_stale_old_logprobs_preset_corrupts_only_the_last_rank_and_the_burst_spikes(tmp_path) -> None:
    case = MatrixCase("stale_old_logprobs", "stale_old_logprobs", FAMILY_PRESETS["stale_old_logprobs"], "preset")
    run = capture_case(case, tmp_path)
    snapshots = burst_snapshots(run, case.preset)
    assert snapshots, f"no spike at the burst: grad norms {run.grad_norms}"
    snapshot = snapshots[0]
    assert read_metadata(snapshot)[0].spike_ratio > 5
    for rank, factor in ((0, 1.0), (1, 2.0)):  # old log-probs counted twice on the last rank only
        batch = load_rank_batch(snapshot, rank)
        mask = batch["loss_mask"].bool()
        old, rollout = batch["old_logprobs"][mask], batch["rollout_logprobs"][mask]
        assert torch.allclose(old, factor * rollout, atol=0.05 * factor, rtol=0.05), rank


@pytest.mark.matrix
@pytest.mark.parametrize("model", ARCHITECTURES)
@pytest.mark.parametrize("case", PRESET_CASES, ids=[c.name for c in PRESET_CASES])
def test_each_family_preset_spikes_at_its_burst(case: MatrixCase, model: str, tmp_path) -> None:
    run = capture_case(case, tmp_path, model=model)
    assert burst_snapshots(run, case.preset), f"{case.name} on {model}: no spike at the burst ({run.grad_norms})"
