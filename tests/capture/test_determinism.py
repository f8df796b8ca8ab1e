"""The reference trainer is deterministic for a seed: same seed, same spikes, same snapshot grad norms and batches."""

from __future__ import annotations

import pytest
import torch

from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
from axrl_spike_replay.snapshot.rank_data import load_grad_info, load_rank_batch


# Its own three runs, not the session's capture: a pair recorded alike (one world size 1 process, 21 steps, so the
# burst trips at [20, 21]) and one with another seed; the session's ratio_outliers run is 32 steps at world size 2.
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list:
    return [
        capture_reference_run(tmp_path_factory.mktemp(f"det{i}"), preset="ratio_outliers", seed=seed, steps=21)
        for i, seed in enumerate((3, 3, 4))
    ]


def test_same_seed_gives_identical_snapshots(runs) -> None:
    first, second, _ = runs
    assert first.grad_norms == second.grad_norms
    assert first.spike_iterations == second.spike_iterations == [20, 21]
    for a, b in zip(first.snapshot_dirs, second.snapshot_dirs, strict=True):
        assert load_grad_info(a, 0) == load_grad_info(b, 0)
        batch_a, batch_b = load_rank_batch(a, 0), load_rank_batch(b, 0)
        assert all(torch.equal(batch_a[k], batch_b[k]) for k in batch_a)


def test_another_seed_gives_another_run(runs) -> None:
    assert runs[0].grad_norms != runs[2].grad_norms


def test_world_size_two_matches_its_own_recorded_snapshot(captured_run) -> None:
    # Ranks agree: each snapshot holds one grad norm, the same in every rank's grad info.
    for snapshot in captured_run.snapshot_dirs:
        assert load_grad_info(snapshot, 0)["grad_norm"] == load_grad_info(snapshot, 1)["grad_norm"]
        assert load_grad_info(snapshot, 0)["param_grad_norms"] != load_grad_info(snapshot, 1)["param_grad_norms"]
