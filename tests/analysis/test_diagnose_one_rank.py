"""The one_rank_data cause family on hand-edited copies of the golden snapshot: one rank's recorded local grad norm far
above the others', or one rank's samples carrying the attributed norm."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from snapshot_edits import copy_fixture, edit_batch, edit_grad_info, no_mismatch

from axrl_spike_replay.analysis.grad_info import top_param_grads
from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot


def _families(diagnosis) -> dict[str, float]:
    return {c.family: c.strength for c in diagnosis.causes}


def test_one_ranks_recorded_local_norm_far_above_the_others_names_that_rank(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    local = {k.rank: k.local_grad_norm for k in top_param_grads(snapshot).ranks}
    edit_grad_info(
        snapshot,
        1,
        lambda info: info.update(param_grad_norms={k: 12.0 * v for k, v in info["param_grad_norms"].items()}),
    )
    d = diagnose_snapshot(snapshot, model="never")
    cause = next(c for c in d.causes if c.family == "one_rank_data")
    assert cause.title == "one rank's data (rank 1)" and cause.figures == {"rank": 1}
    factor = 12.0 * local[1] / local[0]
    assert cause.strength == pytest.approx(min(0.6, 0.2 * math.log2(factor)))
    assert f"is {factor:.3g}x the other ranks' median" in cause.evidence[0]
    assert cause.ranks == [1]
    # without attribution there is no sample to name: only the whole rank is left out
    assert [e.mitigation for e in cause.experiments] == ["drop_ranks=1"]


def test_one_rank_stays_silent_on_balanced_ranks(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    assert "one_rank_data" not in _families(diagnose_snapshot(snapshot, model="never"))


@pytest.mark.slow
def test_one_ranks_samples_carrying_the_norm_name_that_rank_with_its_samples(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    edit_batch(snapshot, 0, lambda b: b.__setitem__("advantages", b["advantages"] * 50.0))  # all of rank 0's
    d = diagnose_snapshot(snapshot, model="always")
    cause = next(c for c in d.causes if c.family == "one_rank_data")
    assert cause.figures == {"rank": 0} and cause.strength >= 0.7  # and every stored signal of rank 0 agrees
    assert "every stored signal of rank 0 agrees with the replay" in cause.evidence
    share = sum(s["share"] for s in d.attribution_top if s["rank"] == 0)
    assert any(line.startswith("rank 0's top samples carry") for line in cause.evidence)
    assert share > 0.8
    whole, item = [e.mitigation for e in cause.experiments]
    assert whole == "drop_ranks=0"
    assert item.startswith("drop_samples=0:") and all(p.startswith("0:") for p in item.split("=")[1].split(","))
