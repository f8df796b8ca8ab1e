"""A run trained under verl's loss convention with global normalisation, captured at world size 2 and replayed:
bit-identical at full fidelity, within 1e-5 when one process stands in for both ranks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.snapshot.rank_data import load_grad_info
from axrl_spike_replay.training.loss_normalization import GRAD_INFO_KEY

VERL_LOSS = {
    "convention": "verl",
    "is_base_logprobs": "old",
    "normalization": "global",
    "loss_agg_mode": "seq-mean-token-sum-norm",
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": 1.5,
}


# Its own capture, not the session's negative_advantage_dominance run: trained under verl's loss convention.
@pytest.fixture(scope="module")
def verl_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run

    logging.getLogger("axrl_spike_replay.guard").setLevel(logging.ERROR)
    out = tmp_path_factory.mktemp("verl-capture")
    run = capture_reference_run(
        out,
        job="verl-moe",
        world_size=2,
        steps=22,
        preset="negative_advantage_dominance",
        overrides={"loss": VERL_LOSS},
    )
    assert run.snapshot_dirs, "the burst should trip the guard"
    return Path(run.snapshot_dirs[-1])


@pytest.mark.slow
def test_the_snapshot_records_the_convention_and_the_steps_global_counts(verl_snapshot: Path) -> None:
    loss = yaml.safe_load((verl_snapshot / "run_config.yaml").read_text(encoding="utf-8"))["loss"]
    assert (loss["convention"], loss["convention_version"], loss["normalization"]) == ("verl", "0.9.1", "global")
    counts = [load_grad_info(verl_snapshot, rank)[GRAD_INFO_KEY] for rank in (0, 1)]
    assert counts[0] == counts[1] and counts[0]["dp_size"] == 2
    local = [float(torch.load(verl_snapshot / f"batch_rank{r}.pt")["loss_mask"].sum()) for r in (0, 1)]
    assert counts[0]["batch_num_tokens"] <= sum(local)  # rejection sampling may drop some


@pytest.mark.slow
def test_full_fidelity_replay_is_bit_identical(verl_snapshot: Path, warm_runner: JobRunner) -> None:
    result = run_replay(replay_request(What(verl_snapshot), how=How(nproc=2)), runner=warm_runner)
    assert result.fidelity == "full"
    assert result.grad_norm == result.recorded_grad_norm


@pytest.mark.slow
def test_reduced_replay_gets_the_global_counts_and_stays_close(verl_snapshot: Path) -> None:
    result = run_replay(replay_request(What(verl_snapshot), how=How(nproc=1)))
    assert result.fidelity == "full"
    assert result.rel_diff is not None and result.rel_diff <= 1e-5


@pytest.mark.slow
def test_a_mitigated_config_replays_alike_at_every_layout(verl_snapshot: Path, warm_runner: JobRunner) -> None:
    # On this capture pi_old/pi_rollout is within 1 % of 1 on every loss token (a [0.99, 1.01] mask rejects none),
    # so no rejection changes the counts; test_global_normalization_replay.py has a mitigation that masks tokens,
    # and checks the replay recounts them.
    mitigation = {"ratio_outlier_mask": "token"}
    full = run_replay(replay_request(What(verl_snapshot, mitigations=mitigation), how=How(nproc=2)), runner=warm_runner)
    reduced = run_replay(replay_request(What(verl_snapshot, mitigations=mitigation), how=How(nproc=1)))
    assert full.grad_norm is not None and reduced.grad_norm is not None
    assert abs(full.grad_norm - reduced.grad_norm) <= 1e-5 * full.grad_norm
    # the clean gradient leaves the same tokens out, recounted over both ranks, whichever process holds a rank
    clean_full, clean_reduced = full.clean_gradient, reduced.clean_gradient
    assert clean_full is not None and clean_reduced is not None and (clean_full.passes or 0) > 0
    for key in ("tokens_left_out", "loss_tokens", "left_out", "reached"):
        assert getattr(clean_full, key) == getattr(clean_reduced, key), key
    assert clean_reduced.grad_norm == pytest.approx(clean_full.grad_norm, rel=1e-5)
