"""A Megatron `torch_dist` checkpoint read straight into FSDP2 shards: two gloo processes build the transformers
policy on the meta device, shard it, and each reads only its rows of each checkpoint key, a layer at a time (the
fused QKV split per layer). Every process's rows equal those of the policy loaded whole, from every saved layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.models.policy import build_policy, load_policy_weights, parse_model_config
from axrl_spike_replay.processes.rank_processes import spawn_ranks

pytestmark = pytest.mark.slow  # spawned gloo processes building transformers models


def _check_shards(rank: int, world_size: int, payload: tuple[str, str]) -> None:
    from axrl_spike_replay.models.sharded_weights import local_rows
    from axrl_spike_replay.replay.compute.model_build import Placement, build_model
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    directory, report = payload
    spec = parse_model_config(tiny_section())
    whole = build_policy(spec)
    load_policy_weights(whole, spec, directory)
    saved = dict(whole.state_dict())
    model = build_model(spec, directory, "cpu", Placement(shard=True))
    held = 0
    for name, param in model.named_parameters():
        row, local = local_rows(param)
        assert torch.equal(local, saved[name][row : row + local.shape[0]]), name
        held += local.numel()
    Path(f"{report}.{rank}").write_text(json.dumps([held, sum(p.numel() for p in whole.parameters())]))


@pytest.mark.parametrize(
    "layout", [pytest.param("tp1", marks=pytest.mark.matrix), "ep2", pytest.param("tp2", marks=pytest.mark.matrix)]
)
def test_each_process_reads_its_rows_of_a_megatron_checkpoint(
    megatron_checkpoints: dict[str, Path], layout: str, tmp_path: Path
) -> None:
    report = tmp_path / "held"
    spawn_ranks(_check_shards, 2, (str(megatron_checkpoints[layout]), str(report)))
    rows = [json.loads(Path(f"{report}.{r}").read_text()) for r in range(2)]
    assert sum(h for h, _ in rows) == rows[0][1] and all(h < whole for h, whole in rows)
