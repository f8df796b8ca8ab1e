"""Weights straight into FSDP2 shards: two gloo processes build a qwen3_moe policy on the meta device, shard it with
`fully_shard`, and each reads only its own rows, from a verl FSDP actor checkpoint (saved by two other ranks, the
way verl's checkpoint manager saves it) and from an HF safetensors directory (`save_pretrained`). Every process's
rows equal the same rows of the policy that was saved, and each holds only part of the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.models.policy import parse_model_config
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.testing.hf_snapshot import seeded_policy

pytestmark = pytest.mark.slow  # spawned gloo processes building transformers models


def _save_like_verl(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    _, policy = seeded_policy("qwen3_moe")
    actor = policy.causal_lm
    fully_shard(actor)
    torch.save(actor.state_dict(), Path(out) / f"model_world_size_{world_size}_rank_{rank}.pt")
    if rank == 0:
        (Path(out) / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
        actor.config.save_pretrained(Path(out) / "huggingface")


def _check_shards(rank: int, world_size: int, payload: tuple[str, str, str]) -> None:
    from axrl_spike_replay.models.sharded_weights import local_rows
    from axrl_spike_replay.replay.compute.model_build import Placement, build_model

    weights_path, empty, report = payload
    spec = parse_model_config({"kind": "hf", "architecture": "qwen3_moe", "path": weights_path})
    model = build_model(spec, empty, "cpu", Placement(shard=True))
    _, original = seeded_policy("qwen3_moe")
    saved = dict(original.state_dict())
    held, whole = 0, 0
    for name, param in model.named_parameters():
        row, local = local_rows(param)
        want = saved[name][row : row + local.shape[0]]
        assert torch.equal(local, want), name
        held += local.numel()
        whole += param.numel()
    Path(report).with_name(f"{Path(report).name}.{rank}").write_text(json.dumps([held, whole]))


def _held(report: Path, world_size: int) -> list[list[int]]:
    return [json.loads(report.with_name(f"{report.name}.{r}").read_text()) for r in range(world_size)]


def test_each_process_reads_its_rows_from_a_verl_fsdp_checkpoint(tmp_path: Path) -> None:
    actor_dir = tmp_path / "global_step_3" / "actor"
    actor_dir.mkdir(parents=True)
    spawn_ranks(_save_like_verl, 2, str(actor_dir))
    empty = tmp_path / "snapshot"
    empty.mkdir()
    report = tmp_path / "held"
    spawn_ranks(_check_shards, 2, (str(actor_dir), str(empty), str(report)))
    rows = _held(report, 2)
    assert sum(h for h, _ in rows) == rows[0][1]  # the two processes hold the model between them, once
    assert all(h < whole for h, whole in rows)


def test_each_process_reads_its_rows_from_safetensors(tmp_path: Path) -> None:
    _, original = seeded_policy("qwen3_moe")
    hf_dir = tmp_path / "hf"
    original.causal_lm.save_pretrained(hf_dir)
    assert list(hf_dir.glob("*.safetensors"))
    empty = tmp_path / "snapshot"
    empty.mkdir()
    report = tmp_path / "held"
    spawn_ranks(_check_shards, 2, (str(hf_dir), str(empty), str(report)))
    rows = _held(report, 2)
    assert sum(h for h, _ in rows) == rows[0][1]
    assert all(h < whole for h, whole in rows)
