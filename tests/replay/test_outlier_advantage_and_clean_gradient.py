"""A spike from one sample whose advantage was scaled 200x: the new mitigations clear it, and every mitigated
replay says how much it changed besides the spike (footprint, cosine to the clean gradient)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
from axrl_spike_replay.experiment.result import SweepResult
from axrl_spike_replay.experiment.verdict import MitigatedBasis
from axrl_spike_replay.investigation.request import What, Where, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.vocabulary import Verdict

OUTLIER = (0, 1, 200.0)  # rank 0 sample 1: its advantage scaled 200x
CONFIGS = [
    {"advantage_outlier_mask": 5},
    {"drop_samples": "0:1"},
    {"advantage_clip": 1e6},  # changes nothing on this batch
    {"advantage_clip": 1},
]


@pytest.fixture(scope="module")
def outlier_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_tiny_snapshot(
        tmp_path_factory.mktemp("outlier") / "spike_snapshots", world_size=2, burst=False, advantage_outlier=OUTLIER
    )


@pytest.fixture(scope="module")
def sweep(outlier_snapshot: Path) -> SweepResult:
    return run_request(replay_request(What(outlier_snapshot, verb="sweep", configs=CONFIGS)))


def _by_id(sweep: SweepResult) -> dict[str, object]:
    return {next(iter(r.mitigations)): r for r in sweep.results}


@pytest.mark.slow
def test_the_outlier_advantage_spike_is_cleared_by_masking_outlier_advantages(sweep: SweepResult) -> None:
    assert sweep.baseline.verdict == Verdict.REPRODUCED
    assert sweep.baseline.spike_ratio is not None and sweep.baseline.spike_ratio > 5
    masked = sweep.results[0]
    assert masked.verdict == Verdict.CLEARED
    assert masked.footprint is not None and masked.footprint.masked_samples == 1  # only the outlier


@pytest.mark.slow
def test_dropping_the_top_sample_clears_it_and_matches_the_clean_gradient(sweep: SweepResult) -> None:
    dropped = sweep.results[1]
    assert dropped.verdict == Verdict.CLEARED
    clean = dropped.clean_gradient
    # the outlier's tokens carry the pull: leaving them out, and only them, gets under the spike bar
    assert clean is not None and clean.left_out == clean.wholly_left_out == ["0:1"]
    assert clean.reached is True and clean.ratio_to_median < dropped.threshold
    # the reference takes the old and rollout log-probs from the forward (the on-policy gradient), the replay of
    # drop_samples the stored ones: equal up to the float32 they were stored in
    assert clean.recomputed == ["old_logprobs", "rollout_logprobs"]
    assert dropped.cosine_to_clean == pytest.approx(1.0, abs=1e-4)
    # the smallest count the search found: one token fewer is still a spike (0 left out: the on-policy gradient)
    count = clean.tokens_left_out
    assert count > 0 and clean.probe_norms[str(count - 1)] >= clean.bar > clean.grad_norm
    assert clean.passes == len(clean.probe_norms) + 1  # + the on-policy gradient


@pytest.mark.slow
def test_every_mitigated_replay_reports_its_footprint_and_cosine(sweep: SweepResult) -> None:
    for result in sweep.results:
        assert result.footprint is not None and result.cosine_to_clean is not None
        for key in ("token_fraction", "sample_fraction", "masked_token_fraction", "masked_sample_fraction"):
            assert 0.0 <= getattr(result.footprint, key) <= 1.0
        assert -1.0 <= result.cosine_to_clean <= 1.0
        assert result.clean_gradient is not None and result.clean_gradient.definition
    no_op, clipped = sweep.results[2], sweep.results[3]
    assert no_op.footprint is not None and no_op.footprint.token_fraction == 0.0
    # the no-op keeps the spike: its gradient is the baseline's, far from the clean one
    assert no_op.cosine_to_clean is not None and no_op.cosine_to_clean < 0.5
    assert no_op.cosine_to_clean == pytest.approx(no_op.clean_gradient.baseline_cosine, rel=1e-9)
    # clipping clears it too, but bends the healthy gradient more than masking the one sample
    assert clipped.cosine_to_clean is not None and clipped.cosine_to_clean < sweep.results[0].cosine_to_clean


@pytest.mark.slow
def test_a_clear_threshold_of_the_users_changes_the_verdict(outlier_snapshot: Path, sweep: SweepResult) -> None:
    clipped = sweep.results[3]
    assert clipped.verdict == Verdict.CLEARED and clipped.verdict_basis.threshold_source == "detector"
    strict = clipped.spike_ratio * 0.9  # under the user's stricter threshold the clipped spike is not cleared
    result = run_request(
        replay_request(
            What(outlier_snapshot, mitigations={"advantage_clip": 1}, clear_threshold=strict),
        )
    )
    assert result.verdict == Verdict.PARTIAL
    assert result.threshold == pytest.approx(strict)
    basis = result.verdict_basis
    assert isinstance(basis, MitigatedBasis)
    assert basis.threshold_source == "clear_threshold" and basis.detector_threshold == 5.0
    assert basis.ratio_to_median == pytest.approx(result.spike_ratio)
    assert "partial" in basis.rule
    # the clean gradient is cleaned under the same, stricter bar
    assert result.clean_gradient is not None and result.median_norm is not None
    assert result.clean_gradient.bar == pytest.approx(strict * result.median_norm)
    assert result.clean_gradient.ratio_to_median < strict


def test_bad_values_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="advantage_outlier_mask"):
        parse_mitigation_args(["advantage_outlier_mask=-1"])
    with pytest.raises(ConfigError, match="rank:sample"):
        parse_mitigation_args(["drop_samples=0-1"])
    with pytest.raises(ConfigError, match="clear_threshold"):
        replay_request(What("/nowhere", clear_threshold=0))
    with pytest.raises(ConfigError, match="clear_threshold"):
        replay_request(What("/nowhere", clear_threshold=2.0), where=Where(target="root@node"))
