"""A batch the policy finds hard on every rank (responses it would never sample, scored right by every worker) is a
natural spike, even when by chance a few of one rank's tokens carry the KL term: a rank's tokens far less likely
than the policy's own samples would be (its surprise past its entropy) fill k3's tail whatever the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.testing.fault_matrix import burst_snapshots, capture_case, matrix_cases


@pytest.mark.slow
def test_a_hard_batch_whose_kl_term_one_rank_carries_by_chance_is_a_natural_spike(tmp_path: Path) -> None:
    case = next(c for c in matrix_cases(("preset",)) if c.name == "hard_batch")
    run = capture_case(case, tmp_path, seed=2)
    snapshots = burst_snapshots(run, case.preset)
    assert snapshots, f"no spike at the burst: {run.grad_norms}"
    d = diagnose_snapshot(snapshots[0], model="always")
    assert d.reading is not None and d.step is not None and d.step.channel is not None
    assert all(v > 3.0 for v in d.reading.surprise.values())  # nats per token past the policy's entropy
    kl = d.step.channel.term("kl")
    assert kl is not None and max(x.share for x in kl.ranks) > 0.5  # one rank's KL term carries it
    assert d.top.family == "natural_spike"
    assert "bad_ref_logprobs" not in {c.family for c in d.causes if c.strength >= 0.3}
