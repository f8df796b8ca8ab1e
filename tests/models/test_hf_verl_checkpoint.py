"""A replay takes an HF policy's weights from a verl FSDP actor checkpoint.

Two gloo processes shard a qwen3_moe policy with FSDP2's `fully_shard` and save it as verl 0.9.1's
`FSDPCheckpointManager` does (each rank's state dict of DTensors as `model_world_size_2_rank_{r}.pt`,
`fsdp_config.json`, the HF config under `huggingface/`). `model.path` naming that directory loads the
merged weights, and the policy gives the logits of the policy that was sharded, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.models.policy import build_policy, load_policy_weights, parse_model_config
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.testing.hf_snapshot import seeded_policy

pytestmark = pytest.mark.slow  # two spawned gloo processes building a transformers model


def _save_like_verl(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    _, policy = seeded_policy("qwen3_moe")
    actor = policy.causal_lm  # what verl's actor module is: the transformers model itself
    fully_shard(actor)
    torch.save(actor.state_dict(), Path(out) / f"model_world_size_{world_size}_rank_{rank}.pt")
    if rank == 0:
        (Path(out) / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
        actor.config.save_pretrained(Path(out) / "huggingface")


def test_a_verl_actor_checkpoint_loads_as_the_policy_that_was_sharded(tmp_path: Path) -> None:
    actor_dir = tmp_path / "global_step_3" / "actor"
    actor_dir.mkdir(parents=True)
    spawn_ranks(_save_like_verl, 2, str(actor_dir))
    spec = parse_model_config({"kind": "hf", "architecture": "qwen3_moe", "path": str(actor_dir)})

    replayed = build_policy(spec)
    empty_snapshot_weights = tmp_path / "snapshot"  # no checkpoint in the snapshot: the spec's path is used
    empty_snapshot_weights.mkdir()
    load_policy_weights(replayed, spec, empty_snapshot_weights)

    _, original = seeded_policy("qwen3_moe")
    tokens = torch.randint(3, 1024, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(replayed(tokens).logits, original(tokens).logits)
    saved = dict(original.named_parameters())
    assert all(torch.equal(p, saved[name]) for name, p in replayed.named_parameters())
