"""Replaying a fresh reference-trainer capture at the demo's sizes (world size 2, 8 samples per rank)."""

from __future__ import annotations

import pytest

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner


def test_every_captured_spike_reproduces_reduced(captured_run) -> None:
    assert captured_run.snapshot_dirs
    for snapshot in captured_run.snapshot_dirs:
        result = run_replay(replay_request(What(snapshot), how=How(nproc=1)))
        assert result.fidelity == "full"
        assert result.rel_diff <= 1e-5, snapshot
        assert result.verdict == "reproduced"


def test_the_worst_captured_spike_reproduces_at_full_fidelity(captured_run, warm_runner: JobRunner) -> None:
    worst = captured_run.snapshot_dirs[captured_run.spike_ratios.index(max(captured_run.spike_ratios))]
    result = run_replay(replay_request(What(worst)), runner=warm_runner)  # default: the saved world size
    assert (result.fidelity, result.world_size_used) == ("full", 2)
    assert result.rel_diff <= 1e-6
    assert result.spike_ratio == pytest.approx(max(captured_run.spike_ratios), rel=1e-6)
