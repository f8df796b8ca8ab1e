"""Diagnose's model evidence with the policy sharded by FSDP2 over gloo processes: on a snapshot with a routing payload
planted on one rank, every stored signal per rank, the route agreement per rank and MoE layer, the loss channel per
term and rank, and the attribution are the unsharded figures (within 1e-6), and so are the causes drawn from them.
A model that does not fit one process gets its evidence sharded by itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from snapshot_edits import copy_fixture, no_mismatch, shift_routes

from axrl_spike_replay.diagnosis.diagnose import Diagnosis, diagnose_snapshot
from axrl_spike_replay.investigation.request import How
from axrl_spike_replay.vocabulary import Shard

pytestmark = pytest.mark.slow  # each sharded diagnosis starts 1-2 processes: tens of seconds on two cores

REL = 1e-6


def _close(got: Any, want: Any, path: str = "", near_zero: float = 1e-12, rel: float = REL) -> None:
    """The same document, floats within `rel` (relative, or `near_zero` absolute)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for key in want:
            _close(got[key], want[key], f"{path}.{key}", near_zero, rel)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _close(a, b, f"{path}[{i}]", near_zero, rel)
    elif isinstance(want, float) and not isinstance(got, bool):
        assert math.isclose(got, want, rel_tol=rel, abs_tol=near_zero), (path, got, want)
    else:
        assert got == want, (path, got, want)


def _same_diagnosis(sharded: Diagnosis, whole: Diagnosis) -> None:
    assert sharded.step is not None and whole.step is not None
    _close(sharded.step.signals.to_json(), whole.step.signals.to_json(), "signals")
    assert sharded.step.channel is not None and whole.step.channel is not None
    got, want = sharded.step.channel.to_json(), whole.step.channel.to_json()
    # the terms' sum against g: float noise itself (~1e-7), in a summation order that may differ
    assert got.pop("sum_rel_error") <= 1e-6 and want.pop("sum_rel_error") <= 1e-6
    # each rank's own per-parameter norms: the whole evidence's, summed over the shards and the micro-batches in
    # another order (float32 noise apart: 1.6e-6 seen on the head, whose gradient sums the most terms, hence 1e-5,
    # the tolerance of a process summing several ranks); their dots are the whole evidence's alone
    _close(got.pop("rank_param_norms"), want.pop("rank_param_norms"), "rank_param_norms", 1e-9, 1e-5)
    assert got.pop("param_gram") == {} and want.pop("param_gram")
    assert not any(n.startswith("param_grad_norms_vs_replay") for n in sharded.not_checked), sharded.not_checked
    _close(got, want, "channel")
    assert sharded.routes is not None and whole.routes is not None
    _close([vars(x) for x in sharded.routes.layers], [vars(x) for x in whole.routes.layers], "routes")
    # shares of the grad norm: the sharded attribution's are within 1e-6 of the norm, not of each share
    _close(sharded.attribution_top, whole.attribution_top, "attribution_top", REL)
    got = [(c.family, c.ranks, round(c.strength, 6)) for c in sharded.causes]
    assert got == [(c.family, c.ranks, round(c.strength, 6)) for c in whole.causes]


@pytest.fixture(scope="module")
def shifted_routes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Diagnosis]:
    """The toy fixture's spike with rank 1's routing payload shifted to other experts, diagnosed unsharded."""
    snapshot = copy_fixture(tmp_path_factory.mktemp("shifted-routes"))
    no_mismatch(snapshot)
    shift_routes(snapshot, rank=1)
    return snapshot, diagnose_snapshot(snapshot, model="always", how=How(shard=Shard.OFF))


# In the default run the two-process case is test_a_model_that_does_not_fit_one_process_is_diagnosed_sharded: shard
# auto over the saved world size is the same sharded diagnosis, and it asserts what this test does.
@pytest.mark.matrix
@pytest.mark.parametrize("nproc", [1, 2])
def test_sharded_model_evidence_gives_the_unsharded_figures_and_causes(
    shifted_routes: tuple[Path, Diagnosis], nproc: int
) -> None:
    snapshot, whole = shifted_routes
    sharded = diagnose_snapshot(snapshot, model="always", how=How(shard=Shard.ON, nproc=nproc))
    _same_diagnosis(sharded, whole)
    # the payload was edited after the capture: the step does not reproduce (first), the routes on rank 1 are found
    assert sharded.top.family == whole.top.family == "step_not_reproduced"
    assert any(c.family == "routing_payload" and c.ranks == [1] for c in sharded.causes)
    ranks = {r.rank: r.route_disagreement() for r in sharded.step.signals.ranks} if sharded.step else {}
    assert ranks[1] is not None and ranks[1] > 0.5 and ranks[0] == 0.0  # the planted rank, and its witness


def test_a_model_that_does_not_fit_one_process_is_diagnosed_sharded(
    shifted_routes: tuple[Path, Diagnosis], monkeypatch: pytest.MonkeyPatch
) -> None:
    from axrl_spike_replay.replay.plans import shard_choice

    snapshot, whole = shifted_routes
    monkeypatch.setattr(shard_choice, "available_memory_bytes", lambda: 1 << 10)  # a machine with 1 KiB free
    sharded = diagnose_snapshot(snapshot, model="always")  # shard auto, over the saved world size
    _same_diagnosis(sharded, whole)
    # the payload was edited after the capture: the step does not reproduce (first), the routes on rank 1 are found
    assert sharded.top.family == whole.top.family == "step_not_reproduced"
    assert any(c.family == "routing_payload" and c.ranks == [1] for c in sharded.causes)
    ranks = {r.rank: r.route_disagreement() for r in sharded.step.signals.ranks} if sharded.step else {}
    assert ranks[1] is not None and ranks[1] > 0.5 and ranks[0] == 0.0  # the planted rank, and its witness
    assert not any("model evidence" in line for line in sharded.not_checked), sharded.not_checked
    alone = diagnose_snapshot(snapshot, model="always", how=How(nproc=1))  # one process cannot shard: said, not raised
    assert alone.step is None
    assert any("run it sharded (`shard` on, `nproc` > 1)" in line for line in alone.not_checked), alone.not_checked


def test_sharded_model_evidence_of_a_qwen3_moe_with_a_shifted_payload(tmp_path: Path) -> None:
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    snapshot = record_hf_snapshot(tmp_path, "qwen3_moe", world_size=2)
    path = snapshot / "routing_payload_rank1.pt"
    payload = torch.load(path, weights_only=True)
    routes = payload["routed_experts"]
    payload["routed_experts"] = torch.where(routes >= 0, (routes + 1) % (int(routes.max()) + 1), routes)
    torch.save(payload, path)
    no_mismatch(snapshot)  # the recorder's own engine mismatch taken out
    whole = diagnose_snapshot(snapshot, model="always", how=How(shard=Shard.OFF))
    sharded = diagnose_snapshot(snapshot, model="always", how=How(shard=Shard.ON, nproc=2))
    _same_diagnosis(sharded, whole)
    assert any(c.family == "routing_payload" and c.ranks == [1] and c.strength == 1.0 for c in sharded.causes)
