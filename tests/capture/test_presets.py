"""Each preset's burst is a genuine spike, and the replay-only mitigation that targets its cause removes it.

The ratio_outliers and negative_advantage_dominance captures are the session's (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from capture_helpers import recompute_grad_norm

from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.rank_data import load_rank_batch

THRESHOLD = 5.0


@pytest.mark.parametrize(
    "mitigation",
    [{"mismatch_token_clip_max": 2.0}, {"is_base_logprobs": "old"}, {"dual_clip_c": 3.0}],
    ids=["mismatch_token_clip_max=2", "is_base_logprobs=old", "dual_clip_c=3"],
)
def test_ratio_outlier_spikes_are_cleared_by_ratio_mitigations(captured_run, mitigation) -> None:
    for snapshot in captured_run.snapshot_dirs:
        meta, _ = read_metadata(snapshot)
        mitigated = recompute_grad_norm(snapshot, **mitigation)
        assert mitigated / meta.median_norm < THRESHOLD < meta.spike_ratio


def test_negative_advantage_dominance_spikes_on_the_burst_with_all_advantages_negative(negative_advantage_run) -> None:
    assert negative_advantage_run.spike_iterations == [20, 21, 22]
    assert min(negative_advantage_run.spike_ratios) > 10 * THRESHOLD
    batch = load_rank_batch(negative_advantage_run.snapshot_dirs[0], 0)
    assert (batch["advantages"] < -5).all()
    assert torch.equal(batch["rewards"], torch.full_like(batch["rewards"], -10.0))


def test_balancing_or_clipping_advantages_shrinks_the_negative_advantage_spike(negative_advantage_run) -> None:
    snapshot = negative_advantage_run.snapshot_dirs[0]
    meta, _ = read_metadata(snapshot)
    assert recompute_grad_norm(snapshot) == meta.grad_norm
    balanced = recompute_grad_norm(snapshot, balance_negative_advantages=True)
    clipped = recompute_grad_norm(snapshot, advantage_clip=1.0)
    assert balanced / meta.median_norm < THRESHOLD
    assert clipped < meta.grad_norm / 5


def test_a_healthy_run_never_trips(tmp_path) -> None:
    result = capture_reference_run(tmp_path, preset="none", steps=24)
    assert result.spike_iterations == [] and result.snapshot_dirs == []


def test_unknown_preset_is_refused_with_the_known_ones(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"preset 'nope' is not known.*ratio_outliers"):
        capture_reference_run(tmp_path, preset="nope")
    assert not any(tmp_path.iterdir())
