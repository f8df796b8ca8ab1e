"""Diagnose's model evidence sharded over a layout that does not divide the saved ranks evenly (4 saved ranks on 3
processes: 0 | 1 | 2, 3): the processes with one rank pad with forwards and zero turns, and every figure is still
the unsharded one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence

pytestmark = pytest.mark.slow  # three processes


def _close(got: object, want: object, path: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for key in want:
            _close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _close(a, b, f"{path}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12), (path, got, want)
    else:
        assert got == want, (path, got, want)


def test_uneven_sharded_evidence_gives_the_unsharded_figures(tmp_path: Path) -> None:
    snapshot = record_tiny_snapshot(tmp_path / "spike_snapshots", world_size=4)
    mitigations = {"kl_coef": 0.1, "entropy_coef": 0.01}  # every loss term, so the channel has them all
    whole = step_evidence(snapshot, shard="off", mitigations=mitigations)
    sharded = step_evidence(snapshot, shard="on", nproc=3, mitigations=mitigations)
    _close(sharded.signals.to_json(), whole.signals.to_json(), "signals")
    assert whole.channel is not None and sharded.channel is not None
    got, want = sharded.channel.to_json(), whole.channel.to_json()
    # the terms' sum against g: float noise itself (~1e-7), in a summation order that differs
    assert got.pop("sum_rel_error") <= 1e-6 and want.pop("sum_rel_error") <= 1e-6
    # each rank's own per-parameter norms (the record comparison's): summed over uneven shards, the unsharded ones;
    # their dots (the prediction's) are computed unsharded only
    norms = got.pop("rank_param_norms")
    assert [r["rank"] for r in norms] == [0, 1, 2, 3]
    _close(norms, want.pop("rank_param_norms"), "rank_param_norms")
    assert got.pop("param_gram", {}) == {}
    want.pop("param_gram", None)
    _close(got, want, "channel")
    assert [r.rank for r in sharded.signals.ranks] == [0, 1, 2, 3]
    assert {t.term for t in sharded.channel.terms} >= {"policy", "kl", "entropy"}
