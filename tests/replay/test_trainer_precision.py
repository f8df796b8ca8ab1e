"""The trainer's precision: a snapshot records its mixed-precision policy and the replay computes in it.

A bf16-parameter trainer with fp32 reduction (verl's FSDP default) is replayed in bf16 with fp32 reduction, whole
or sharded, and the result says which precision ran. The reference is FSDP2's own mixed precision: the same rank
steps run through `fully_shard(..., mp_policy=MixedPrecisionPolicy(bf16, fp32))` in a one-process gloo group,
which is how such a trainer computes its gradients.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.models.policy import build_policy, load_policy_weights, parse_model_config
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes
from axrl_spike_replay.training.policy_loss import LossConfig
from axrl_spike_replay.training.precision import PrecisionPolicy
from axrl_spike_replay.training.rank_step import rank_forward_backward
from axrl_spike_replay.training.routing_replay import RoutingConfig, routing_control
from axrl_spike_replay.vocabulary import Shard

BF16 = {"param_dtype": "bf16", "reduce_dtype": "fp32"}


def _with_precision(snapshot: Path, precision: Any) -> dict[str, Any]:
    doc = yaml.safe_load((snapshot / "run_config.yaml").read_text(encoding="utf-8"))
    doc["precision"] = precision
    (snapshot / "run_config.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    return doc


def fsdp2_mixed_precision_norm(snapshot: Path, doc: dict[str, Any], tmp: Path) -> float:
    """The step's global grad norm as an FSDP2 trainer with bf16 parameters and fp32 reduction computes it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = int(doc["parallel"]["world_size"])
    store = dist.FileStore(str(tmp / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        spec = parse_model_config(doc["model"])
        model = build_policy(spec)
        load_policy_weights(model, spec, snapshot)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        loss_cfg = LossConfig.from_dict(doc["loss"])
        routing_cfg = RoutingConfig.from_dict(doc["routing"])
        for rank in range(world):
            batch = load_rank_batch(snapshot, rank)
            payload = load_rank_routes(snapshot, rank, batch=batch)
            routes = payload.routed_experts if payload is not None else None
            rank_forward_backward(model, batch, loss_cfg, routing_control(routing_cfg, batch, routes))
        total = 0.0
        for p in model.parameters():
            assert p.grad is not None
            total += float((p.grad.full_tensor().double() / world).pow(2).sum())
        return math.sqrt(total)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def bf16_snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, float]:
    """A tiny spike whose run config records bf16 parameters and fp32 reduction: (snapshot, FSDP2's norm,
    the float32 norm it was recorded with)."""
    root = tmp_path_factory.mktemp("bf16")
    snapshot = record_tiny_snapshot(root / "spike_snapshots", world_size=2)
    fp32 = run_replay(replay_request(What(snapshot), how=How(nproc=1))).grad_norm
    assert fp32 is not None
    doc = _with_precision(snapshot, BF16)
    return snapshot, fsdp2_mixed_precision_norm(snapshot, doc, root), fp32


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "shard"),
    [
        (1, "off"),
        pytest.param(2, "off", marks=pytest.mark.matrix),
        pytest.param(1, "on", marks=pytest.mark.matrix),
        (2, "on"),
    ],
)  # one process whole and two sharded in the default run
def test_a_bf16_trainer_is_replayed_in_bf16_with_fp32_reduction(
    bf16_snapshot: tuple[Path, float, float], nproc: int, shard: str, warm_runner: JobRunner
) -> None:
    snapshot, fsdp2_norm, fp32_norm = bf16_snapshot
    result = run_replay(replay_request(What(snapshot), how=How(nproc=nproc, shard=Shard(shard))), runner=warm_runner)
    assert result.precision == PrecisionPolicy("bfloat16", "float32", None, "run_config")
    assert result.grad_norm is not None
    assert abs(result.grad_norm - fsdp2_norm) <= 1e-6 * fsdp2_norm  # FSDP2's own mixed precision, whole or sharded
    assert abs(result.grad_norm - fp32_norm) > 1e-6 * fp32_norm  # and not the float32 step: bf16 did run


def test_a_snapshot_without_a_precision_section_replays_in_the_models_dtype(tiny_snapshot: Path) -> None:
    result = run_replay(replay_request(What(tiny_snapshot), how=How(nproc=1)))
    assert result.precision == PrecisionPolicy("float32", "float32", None, "model_dtype")


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        ({"param_dtype": "int8"}, "precision.param_dtype must be one of float32, bfloat16, float16"),
        ({"param_dtype": "bf16", "buffer": "fp32"}, "unknown keys"),
        ("bf16", "expected a mapping"),
    ],
)
def test_a_bad_precision_section_is_refused_by_name(
    tiny_snapshot: Path, tmp_path: Path, precision: Any, message: str
) -> None:
    import shutil

    copy = tmp_path / tiny_snapshot.name
    shutil.copytree(tiny_snapshot, copy)
    _with_precision(copy, precision)
    with pytest.raises(ConfigError, match=message):
        run_replay(replay_request(What(copy), how=How(nproc=1)))
