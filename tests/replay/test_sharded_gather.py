"""A sharded replay's backward gathers one FSDP unit at a time, as the plan (`replay.compute.process_memory`) counts it:
FSDP2 would otherwise prefetch the next unit's weights while the current unit computes its gradient."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.testing.hf_snapshot import seeded_policy

pytestmark = pytest.mark.slow  # spawned gloo processes building a transformers model


def _gathers_seen_in_backward(rank: int, world_size: int, payload: tuple[str, str]) -> None:
    """For each decoder layer, in backward order: how many units the backward had gathered when the layer's
    attention output got its gradient (counted through FSDP2's public `set_custom_all_gather`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    from axrl_spike_replay.models.policy import parse_model_config, shard_units
    from axrl_spike_replay.replay.compute.model_build import Placement, build_model

    hf_dir, report = payload
    spec = parse_model_config({"kind": "hf", "architecture": "qwen3_moe", "path": hf_dir})
    model = build_model(spec, hf_dir, "cpu", Placement(shard=True))
    gathers = [0]

    class Counted(DefaultAllGather):
        def __call__(self, *args: object, **kwargs: object) -> object:
            gathers[0] += 1
            return super().__call__(*args, **kwargs)  # type: ignore[arg-type]

    seen: list[int] = []

    def watch(_module: torch.nn.Module, _inputs: object, out: tuple[torch.Tensor, ...]) -> None:
        out[0].register_hook(lambda _grad: seen.append(gathers[0]))

    for unit in shard_units(model):
        assert isinstance(unit, FSDPModule)
        unit.set_custom_all_gather(Counted())
        attention = getattr(unit, "self_attn", None)
        if attention is not None:  # a decoder layer: its attention output's gradient arrives mid-backward
            attention.register_forward_hook(watch)
    tokens = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).logits.float().logsumexp(-1).mean()
    gathers[0] = 0  # the backward's own gathers from here on
    loss.backward()
    Path(f"{report}.{rank}").write_text(json.dumps(seen))


def test_a_sharded_backward_gathers_one_unit_at_a_time(tmp_path: Path) -> None:
    _, policy = seeded_policy("qwen3_moe")
    hf_dir = tmp_path / "hf"
    policy.causal_lm.save_pretrained(hf_dir)
    report = tmp_path / "gathered"
    spawn_ranks(_gathers_seen_in_backward, 2, (str(hf_dir), str(report)))
    layers = policy.causal_lm.config.num_hidden_layers
    for rank in range(2):
        seen = json.loads(Path(f"{report}.{rank}").read_text())
        # mid-backward of the j-th layer from the top, the backward has gathered the output head and layers
        # L-1 .. L-1-j, and none ahead of them
        assert seen == [j + 2 for j in range(layers)], seen
