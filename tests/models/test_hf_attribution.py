"""Attributing the spike of a transformers MoE policy (qwen3_moe, saved world size 2) to its samples: the
contributions, taken through the per-token log-probs, sum to the replayed grad norm and agree with one backward
pass per sample.

The snapshot (`hf_snapshot`, tests/conftest.py) is recorded once per test session with the trainer's own
rank step (axrl_spike_replay.testing.hf_snapshot).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.testing.hf_snapshot import BATCH, BURST
from axrl_spike_replay.vocabulary import Verb


@pytest.fixture(scope="module")
def hf_attribution(hf_snapshot: Path):
    return attribute_spike(replay_request(What(hf_snapshot, verb=Verb.ATTRIBUTE, top=2 * BATCH)))


def test_contributions_of_an_hf_model_sum_to_its_grad_norm(hf_snapshot: Path, hf_attribution) -> None:
    a = hf_attribution
    assert a.total_samples == 2 * BATCH and len(a.samples) == 2 * BATCH
    assert a.sum_rel_error <= 1e-4
    assert sum(s.contribution for s in a.samples) + a.router_term == pytest.approx(a.grad_norm, rel=1e-4)
    assert a.router_term != 0.0  # the routers' aux and z losses, batch-level
    assert a.grad_norm == run_replay(replay_request(What(hf_snapshot), how=How(nproc=1))).grad_norm
    assert {(s.rank, s.sample) for s in a.samples[:2]} == set(BURST)


def test_one_jvp_agrees_with_one_backward_per_sample_on_an_hf_model(hf_snapshot: Path, hf_attribution) -> None:
    naive = attribute_spike(
        replay_request(What(hf_snapshot, verb=Verb.ATTRIBUTE, top=2 * BATCH, method="per_sample_backward"))
    )
    fast = {(s.rank, s.sample): s.contribution for s in hf_attribution.samples}
    assert len(naive.samples) == len(fast)
    for s in naive.samples:
        assert fast[(s.rank, s.sample)] == pytest.approx(s.contribution, rel=1e-4, abs=1e-6 * naive.grad_norm)
    assert naive.router_term == pytest.approx(hf_attribution.router_term, rel=1e-4)
    assert naive.sum_rel_error <= 1e-4


def test_an_entropy_term_is_attributed_through_the_entropies_too(hf_snapshot: Path) -> None:
    mitigations = {"entropy_coef": 0.05}
    fast = attribute_spike(
        replay_request(What(hf_snapshot, verb=Verb.ATTRIBUTE, top=2 * BATCH, mitigations=mitigations))
    )
    naive = attribute_spike(
        replay_request(
            What(hf_snapshot, verb=Verb.ATTRIBUTE, top=2 * BATCH, mitigations=mitigations, method="per_sample_backward")
        )
    )
    assert fast.sum_rel_error <= 1e-4 and naive.sum_rel_error <= 1e-4
    by_sample = {(s.rank, s.sample): s.contribution for s in naive.samples}
    for s in fast.samples:
        assert s.contribution == pytest.approx(by_sample[(s.rank, s.sample)], rel=1e-4, abs=1e-6 * fast.grad_norm)
