"""Replay route 2 (`backend` megatron: megatron-core's own GPTModel, loaded with `dist_checkpointing.load`, routes
forced through its router replay) and the cross-check against route 1 (the transformers model) on the same captured
snapshot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes
from axrl_spike_replay.snapshot.safe_load import load_pt
from axrl_spike_replay.vocabulary import Backend

pytestmark = pytest.mark.slow


def _rewrite(path: Path, doc: dict) -> None:
    """Save an edited payload as a new file: the loaded one maps the old file's pages."""
    path.unlink()
    torch.save(doc, path)


# Both routes recompute in fp32 on CPU with one thread. Route 2 runs the trainer's own modules (at EP=1 instead
# of 2: the experts see the same tokens in another grouping), route 1 transformers' (a different split of QKV,
# the experts' loop, RMSNorm written apart): float32 sums in other orders, a few ulps per op. Measured: route 2
# within 4e-12 of the recorded norm, route 1 within 1e-9; 1e-6 is the torch engine's own bar for a full-fidelity
# CPU replay, so the routes agree as closely as a replay must agree with the run.
CROSS_CHECK_RTOL = 1e-6


def replay_with_megatron(
    snapshot: Path, mitigations: dict[str, Any] | None = None, nproc: int | None = None
) -> ReplayResult:
    where = Where(backend=Backend.MEGATRON)
    return run_replay(replay_request(What(snapshot, mitigations=mitigations or {}), where, How(nproc=nproc)))


def test_route_2_reproduces_the_step_and_agrees_with_route_1(
    megatron_capture: Path, megatron_route1_replay: ReplayResult
) -> None:
    native = replay_with_megatron(megatron_capture)
    assert native.backend == "megatron" and native.verdict == "reproduced"
    assert native.rel_diff is not None and native.rel_diff < CROSS_CHECK_RTOL, native.verdict_basis
    assert native.top_params[0].name.startswith(("decoder.layers.", "embedding.", "output_layer."))  # Megatron's
    transformers = megatron_route1_replay
    assert transformers.backend == "torch" and transformers.grad_norm is not None and native.grad_norm is not None
    assert abs(transformers.grad_norm - native.grad_norm) / native.grad_norm < CROSS_CHECK_RTOL
    losses = {m["rank"]: m["loss"] for m in transformers.rank_metrics}
    native_losses = {m["rank"]: m["loss"] for m in native.rank_metrics}
    assert losses.keys() == native_losses.keys() == {0, 1}
    assert all(abs(losses[r] - native_losses[r]) < 1e-5 * abs(native_losses[r]) for r in losses)
    assert native.consistency is not None and native.consistency.self_consistent


def test_route_2_refuses_what_only_route_1_does(megatron_capture: Path) -> None:
    with pytest.raises(ConfigError, match="mitigations run on the built-in `backend` torch"):
        replay_with_megatron(megatron_capture, mitigations={"advantage_clip": 0.5})
    with pytest.raises(ConfigError, match=r"`nproc` 1: `backend` megatron runs one process per saved"):
        replay_with_megatron(megatron_capture, nproc=1)


def test_no_route_sentinels_take_the_current_router_on_both_routes(megatron_capture: Path, tmp_path: Path) -> None:
    """-1 in a payload leaves the token to the current router: on these weights it picks what was recorded."""
    snapshot = shutil.copytree(megatron_capture, tmp_path / "iter_0000006")
    for rank in (0, 1):
        path = snapshot / f"routing_payload_rank{rank}.pt"
        doc = load_pt(path)
        doc["topk_indices"] = [ids.clone() for ids in doc["topk_indices"]]
        doc["topk_indices"][0][::3] = -1  # every third token of the first MoE layer
        _rewrite(path, doc)
    assert int((load_rank_routes(snapshot, 0).routed_experts < 0).sum()) > 0  # type: ignore[union-attr]
    assert replay_with_megatron(snapshot).verdict == "reproduced"
    assert run_replay(replay_request(What(snapshot))).verdict == "reproduced"


def test_a_payload_that_does_not_fit_the_batch_is_refused_by_name(megatron_capture: Path, tmp_path: Path) -> None:
    snapshot = shutil.copytree(megatron_capture, tmp_path / "iter_0000006")
    path = snapshot / "routing_payload_rank1.pt"
    doc = load_pt(path)
    doc["sequence_length"], doc["micro_batch_size"] = 16, 8  # the same 128 tokens, another micro-batch's shape
    _rewrite(path, doc)
    batch = load_rank_batch(snapshot, 1)
    with pytest.raises(SnapshotError, match=r"routing_payload_rank1\.pt: the routing payload covers 8 samples x 16"):
        load_rank_routes(snapshot, 1, batch=batch)
    with pytest.raises(Exception, match=r"routing_payload_rank1\.pt"):
        run_replay(replay_request(What(snapshot)))
    doc["sequence_length"], doc["micro_batch_size"] = 32, 4
    doc["topk_indices"] = doc["topk_indices"][:1]  # one layer's routes for two listed layers
    _rewrite(path, doc)
    with pytest.raises(SnapshotError, match=r"routing_payload_rank1\.pt: 'moe_layers' lists 2 layers but"):
        load_rank_routes(snapshot, 1, batch=batch)
    doc["moe_layers"] = [0]
    doc["topk_indices"] = [doc["topk_indices"][0][:100]]  # tokens cut short
    _rewrite(path, doc)
    with pytest.raises(SnapshotError, match=r"topk_indices\[0\] \(layer 0\) has shape \(100, 2\)"):
        load_rank_routes(snapshot, 1, batch=batch)


@pytest.mark.parametrize("backend", [Backend.TORCH, Backend.MEGATRON])
def test_a_layout_the_shards_contradict_is_refused_before_anything_is_written(
    megatron_capture: Path, tmp_path: Path, backend: Backend
) -> None:
    """The run config and metadata say TP=2, the checkpoint's shards were saved at TP=1: either route refuses,
    naming the file, what disagrees and the command backend, and writes nothing."""
    snapshot = shutil.copytree(megatron_capture, tmp_path / "iter_0000006")
    config = yaml.safe_load((snapshot / "run_config.yaml").read_text())
    config["parallel"].update(tp=2, world_size=4)
    (snapshot / "run_config.yaml").write_text(yaml.safe_dump(config))
    metadata = json.loads((snapshot / "axrl_metadata.json").read_text())
    metadata["parallel"].update(tp=2, world_size=4)
    (snapshot / "axrl_metadata.json").write_text(json.dumps(metadata))
    workspace = tmp_path / "ws"
    request = replay_request(What(snapshot), Where(backend=backend), workspace=workspace)
    with pytest.raises(
        SnapshotError, match=r"\.metadata: linear_qkv is saved in 1 tensor-parallel shards but .* tp=2.*--backend comm"
    ):
        run_request(request)
    assert not workspace.exists()
