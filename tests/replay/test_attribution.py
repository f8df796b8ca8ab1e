"""Attributing a spike to samples: contributions sum to the grad norm, and the burst samples come first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_snapshot import BURST

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.vocabulary import Method, Shard, Verb


@pytest.fixture(scope="module")
def tiny_attribution(tiny_snapshot: Path):
    return attribute_spike(replay_request(What(tiny_snapshot, verb=Verb.ATTRIBUTE, top=12)))


def test_contributions_sum_to_the_grad_norm(tiny_attribution) -> None:
    a = tiny_attribution
    assert a.total_samples == 12 and len(a.samples) == 12
    assert a.sum_rel_error <= 1e-4
    total = sum(s.contribution for s in a.samples) + a.router_term
    assert total == pytest.approx(a.grad_norm, rel=1e-4)
    assert a.router_term != 0.0  # router aux/z losses are a separate, batch-level term
    assert "router" in a.note


def test_the_burst_samples_rank_on_top(tiny_attribution) -> None:
    a = tiny_attribution
    top2 = {(s.rank, s.sample) for s in a.samples[:2]}
    assert top2 == set(BURST)
    contributions = [s.contribution for s in a.samples]
    assert contributions == sorted(contributions, reverse=True)
    first = a.samples[0]
    assert first.advantage == pytest.approx(-2.0) and first.loss_tokens > 0
    assert first.max_abs_log_ratio_current_vs_base > 2.5
    assert a.log_ratio_base == "rollout"


def test_attribution_grad_norm_is_the_replayed_one(tiny_snapshot: Path, tiny_attribution) -> None:
    replay = run_replay(replay_request(What(tiny_snapshot), how=How(nproc=1)))
    assert tiny_attribution.grad_norm == replay.grad_norm
    assert tiny_attribution.fidelity == "full"  # every saved rank replayed and reduced over the saved world size


def test_one_jvp_agrees_with_one_backward_per_sample(tiny_snapshot: Path, tiny_attribution) -> None:
    naive = attribute_spike(
        replay_request(What(tiny_snapshot, verb=Verb.ATTRIBUTE, top=12, method="per_sample_backward"))
    )
    fast = {(s.rank, s.sample): s.contribution for s in tiny_attribution.samples}
    for s in naive.samples:
        assert fast[(s.rank, s.sample)] == pytest.approx(s.contribution, rel=1e-4, abs=1e-6 * naive.grad_norm)
    assert naive.router_term == pytest.approx(tiny_attribution.router_term, rel=1e-4)


def test_a_ratio_outlier_capture_is_carried_by_its_outlier_samples(spike_snapshot: Path, workspace: Path) -> None:
    a = run_request(replay_request(What(spike_snapshot, verb="attribute", top=3), workspace=workspace))
    assert a.sum_rel_error <= 1e-4 and len(a.samples) == 3
    assert sum(s.share for s in a.samples) > 0.8  # a few samples carry the spike
    for s in a.samples:
        assert s.advantage < 0  # negative advantage, far-off rollout logprobs
        assert s.max_abs_log_ratio_current_vs_base > 1.0
    doc = json.loads((Path(a.output_dir) / "attribution.json").read_text())
    assert doc["grad_norm"] == a.grad_norm
    assert {"rank", "sample", "contribution"} <= set(doc["samples"][0])


def test_attribution_under_a_mitigation(tiny_snapshot: Path) -> None:
    a = attribute_spike(
        replay_request(What(tiny_snapshot, verb=Verb.ATTRIBUTE, top=3, mitigations={"mismatch_token_clip_max": 2}))
    )
    assert a.mitigations == {"mismatch_token_clip_max": 2.0}
    assert a.sum_rel_error <= 1e-4
    assert a.log_ratio_base == "old"


def test_the_attribution_takes_the_request_as_it_is(tiny_snapshot: Path, tmp_path: Path) -> None:
    """What the request says (top, method, mitigations; the job and command line it is recorded under) is what the
    attribution does: one request, as a replay takes it, built by the faces' own builder."""
    from axrl_spike_replay.investigation.recording import recorder_for

    what = What(
        tiny_snapshot, verb=Verb.ATTRIBUTE, top=2, method=Method.PER_SAMPLE_BACKWARD, mitigations={"entropy_coef": 0.05}
    )
    request = replay_request(what, how=How(shard=Shard.OFF), job="asked-job", command="attribute as asked")
    a = attribute_spike(request, recorder=recorder_for(tmp_path))
    assert len(a.samples) == 2 and a.method == "per_sample_backward" and a.mitigations == {"entropy_coef": 0.05}
    (run,) = (tmp_path / "tmp" / "spike-replay" / "asked-job").iterdir()
    assert (run / "command.txt").read_text().strip() == "attribute as asked"
    assert len(json.loads((run / "attribution.json").read_text())["samples"]) == 2
