"""The clean-gradient ranking on a spike whose fix is known: rank 1's stored old log-probs are stale (6 nats low on
a third of its loss tokens), the ratio is taken against them. Recomputing them, or taking the ratio against the
rollout log-probs (sound here), is the full fix; a log-ratio clip or a dual clip only silences the stale tokens.

Before the clean gradient was the on-policy one it was the baseline without its highest-pull tokens: it kept the
stale rank's clipped tokens out of the gradient as the clips do, so the clips scored 0.998 and the full fixes 0.898.
"""

from __future__ import annotations

import pytest
from snapshot_edits import copy_fixture, no_mismatch, set_loss, stale_old_logprobs

from axrl_spike_replay.experiment.result import SweepResult
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.vocabulary import Verdict

FULL = [{"recompute": "old_logprobs:rank1"}, {"is_base_logprobs": "rollout"}]
PARTIAL = [{"log_ratio_clip": 5}, {"dual_clip_c": 3}]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> SweepResult:
    snapshot = copy_fixture(tmp_path_factory.mktemp("stale"))
    no_mismatch(snapshot)
    set_loss(snapshot, is_base_logprobs="old")
    stale_old_logprobs(snapshot, rank=1)
    return run_request(replay_request(What(snapshot, verb="sweep", configs=[*FULL, *PARTIAL])))


@pytest.mark.slow
def test_full_fixes_score_above_the_clips_that_clear_the_same_spike(sweep: SweepResult) -> None:
    # the edit changes the recorded step, so the baseline is not the recorded norm; it is a spike all the same
    assert sweep.baseline.spike_ratio is not None and sweep.baseline.spike_ratio > 20
    results = sweep.results
    assert all(r.verdict == Verdict.CLEARED for r in results)  # every one clears it: the cosine must tell them apart
    assert all(r.cosine_to_clean is not None for r in results)
    full = [r.cosine_to_clean or 0.0 for r in results[: len(FULL)]]
    partial = [r.cosine_to_clean or 0.0 for r in results[len(FULL) :]]
    assert min(full) == pytest.approx(1.0, abs=1e-4)  # nothing of the stale rank is left in the reference
    assert min(full) > max(partial) + 0.05
    clean = results[0].clean_gradient
    assert clean is not None and clean.recomputed == ["old_logprobs", "rollout_logprobs"]
    assert clean.tokens_left_out == 0 and clean.reached is True
