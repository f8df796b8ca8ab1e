"""The per-rank comparison is the model's, not the reference trainer's: on transformers MoE architectures a routing
payload shifted on one rank and old log-probs gone stale on the other are each found on their own rank, at full
strength, from the same general comparison (qwen3_moe by default; the others with -m matrix)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from snapshot_edits import edit_batch, set_loss, stale_old_logprobs

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.models.architectures import ARCHITECTURES

CASES = [
    pytest.param(a, marks=(pytest.mark.slow,) if a == "qwen3_moe" else (pytest.mark.slow, pytest.mark.matrix))
    for a in ARCHITECTURES
]


@pytest.mark.parametrize("architecture", CASES)
def test_a_shifted_payload_and_stale_old_log_probs_are_each_found_on_their_rank(
    architecture: str, tmp_path: Path
) -> None:
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    snapshot = record_hf_snapshot(tmp_path, architecture, world_size=2)
    path = snapshot / "routing_payload_rank1.pt"
    payload = torch.load(path, weights_only=True)
    routes = payload["routed_experts"]
    experts = int(routes.max()) + 1
    payload["routed_experts"] = torch.where(routes >= 0, (routes + 1) % experts, routes)
    torch.save(payload, path)
    for rank in (0, 1):  # the recorder's own engine mismatch taken out: the ratio against the trainer's log-probs
        edit_batch(snapshot, rank, lambda b: b.__setitem__("rollout_logprobs", b["old_logprobs"].clone()))
    set_loss(snapshot, is_base_logprobs="old")
    stale_old_logprobs(snapshot, rank=0)
    d = diagnose_snapshot(snapshot, model="always")
    found = {c.family: c for c in d.causes if c.strength == 1.0}
    assert found["routing_payload"].ranks == [1], architecture
    assert found["stale_old_logprobs"].ranks == [0], architecture
    assert "engine_mismatch" not in {c.family for c in d.causes}
