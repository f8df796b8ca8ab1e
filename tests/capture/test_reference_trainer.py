"""A reference run (world size 2, ratio_outliers) spikes on the burst and writes complete, replayable snapshots."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from axrl_spike_replay.capture.reference.run_config import parse_run_config
from axrl_spike_replay.models.policy import policy_forward
from axrl_spike_replay.models.tiny_moe import TinyMoEConfig, TinyMoEPolicy
from axrl_spike_replay.snapshot.dcp.checkpoint import load_model_state
from axrl_spike_replay.snapshot.layout import rank_files
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.rank_data import load_grad_info, load_rank_batch, load_routing_payload
from axrl_spike_replay.training.policy_loss import LossConfig
from axrl_spike_replay.training.rank_step import (
    global_grad_norm,
    param_grad_norms,
    rank_forward_backward,
    reduce_gradients,
)
from axrl_spike_replay.training.routing_replay import RoutingConfig, routing_control

BURST = [20, 21, 22]


def _load_model(snapshot, cfg) -> TinyMoEPolicy:
    model = TinyMoEPolicy(TinyMoEConfig.from_dict(cfg["model"]))
    state = model.state_dict()
    load_model_state(snapshot, state)
    model.load_state_dict(state)
    return model


def test_the_detector_trips_exactly_on_the_burst(captured_run) -> None:
    assert captured_run.spike_iterations == BURST
    assert all(ratio > 10 * 5.0 for ratio in captured_run.spike_ratios), captured_run.spike_ratios
    assert [p.name for p in captured_run.snapshot_dirs] == ["iter_0000020", "iter_0000021", "iter_0000022"]
    healthy = [g for i, g in enumerate(captured_run.grad_norms, start=1) if i not in BURST]
    assert max(healthy) < min(captured_run.grad_norms[i - 1] for i in BURST)


def test_output_dir_is_named_and_laid_out_like_a_training_job(captured_run) -> None:
    assert captured_run.output_dir.name == "ref-s0~demo-moe-grpo__actor"
    log = captured_run.log_path.read_text()
    lines = [line for line in log.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 32
    match = re.search(r"iteration\s+20/\s+32 \|.*\| lm loss: (\S+) \| grad norm: (\S+) \|", log)
    assert match and float(match.group(2)) == pytest.approx(captured_run.grad_norms[19], rel=1e-5)
    assert "[spike guard] iteration 21" in log


def test_snapshot_holds_every_rank_and_the_parallel_layout(captured_run) -> None:
    snapshot = captured_run.snapshot_dirs[0]
    meta, legacy = read_metadata(snapshot)
    assert not legacy
    assert (meta.job_name, meta.role, meta.iteration) == ("demo-moe-grpo", "actor", 20)
    assert meta.parallel.world_size == meta.parallel.dp == 2
    assert meta.spike_ratio == pytest.approx(meta.grad_norm / meta.median_norm)
    assert meta.detector.kind == "median_ratio" and meta.detector.threshold == 5.0
    files = rank_files(snapshot)
    assert {kind: sorted(found) for kind, found in files.items()} == {
        "batch": [0, 1],
        "grad_info": [0, 1],
        "routing_payload": [0, 1],
    }


def test_run_config_rebuilds_model_loss_and_routing(captured_run) -> None:
    cfg = yaml.safe_load((captured_run.snapshot_dirs[0] / "run_config.yaml").read_text())
    spec = parse_run_config(cfg)
    assert spec.loss == LossConfig.from_dict(cfg["loss"])
    assert spec.loss.is_base_logprobs == "rollout"
    assert spec.routing == RoutingConfig(replay="all")
    assert cfg["train"]["preset"] == "ratio_outliers" and cfg["train"]["burst"] == BURST
    assert cfg["detector"] == {
        "kind": "median_ratio",
        "window": 10,
        "threshold": 5.0,
        "warmup": 8,
        "warmup_ratio": 10.0,  # armed from step 1
        "max_norm": None,
    }
    assert cfg["parallel"] == {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "ep": 1, "etp": 1, "cp": 1}


def test_batches_are_what_the_loss_consumed(captured_run) -> None:
    snapshot = captured_run.snapshot_dirs[0]
    batch = load_rank_batch(snapshot, 1)
    b, t = batch["tokens"].shape
    assert batch["tokens"].dtype == torch.int64 and (b, t) == (8, 14)
    for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "loss_mask"):
        assert batch[name].dtype == torch.float32 and batch[name].shape == (b, t)
    assert batch["advantages"].shape == (b,) and batch["rewards"].shape == (b,)
    assert batch["group_index"].tolist() == [2, 2, 2, 2, 3, 3, 3, 3]
    assert batch["loss_mask"][:, :6].sum() == 0 and batch["loss_mask"][:, 6:].min() == 1
    grouped = batch["advantages"].view(2, 4)
    assert torch.allclose(grouped.mean(dim=1), torch.zeros(2), atol=1e-5)  # GRPO: group-centred
    routes = load_routing_payload(snapshot, 1)
    assert routes.routed_experts.dtype == torch.int32 and routes.routed_experts.shape == (b, t, 2, 2)
    assert routes.moe_layers == [0, 1] and routes.source == "rollout"


def test_rollout_logprobs_are_the_broken_engine_s_and_old_logprobs_the_trainer_s(captured_run) -> None:
    snapshot = captured_run.snapshot_dirs[0]
    cfg = yaml.safe_load((snapshot / "run_config.yaml").read_text())
    model = _load_model(snapshot, cfg)
    batch = load_rank_batch(snapshot, 0)
    routes = load_routing_payload(snapshot, 0).routed_experts
    with torch.no_grad():
        control = routing_control(RoutingConfig.from_dict(cfg["routing"]), batch, routes)
        fp32 = policy_forward(model, batch, control, need_entropy=False).logprobs  # as the trainer takes them
    on = batch["loss_mask"] > 0
    assert torch.equal(fp32[on], batch["old_logprobs"][on])
    log_ratio = (batch["old_logprobs"] - batch["rollout_logprobs"])[on]
    assert log_ratio.max() > 3.0  # the engine reported logits/0.2: sampled non-argmax tokens look far less likely


def test_recomputing_the_step_with_rank_step_gives_the_recorded_gradients(captured_run) -> None:
    """What a baseline replay does: the saved weights, batches and routes give the recorded grad norm exactly."""
    snapshot = captured_run.snapshot_dirs[1]
    cfg = yaml.safe_load((snapshot / "run_config.yaml").read_text())
    model = _load_model(snapshot, cfg)
    loss_cfg = LossConfig.from_dict(cfg["loss"])
    routing = RoutingConfig.from_dict(cfg["routing"])
    for rank in (0, 1):
        batch = load_rank_batch(snapshot, rank)
        control = routing_control(routing, batch, load_routing_payload(snapshot, rank).routed_experts)
        model.zero_grad(set_to_none=True)
        rank_forward_backward(model, batch, loss_cfg, control)
        info = load_grad_info(snapshot, rank)
        assert param_grad_norms(model) == info["param_grad_norms"]  # the rank's own grads, before reduction
    model.zero_grad(set_to_none=True)
    for rank in (0, 1):
        batch = load_rank_batch(snapshot, rank)
        control = routing_control(routing, batch, load_routing_payload(snapshot, rank).routed_experts)
        rank_forward_backward(model, batch, loss_cfg, control)
    reduce_gradients(model, 2)
    assert global_grad_norm(model) == load_grad_info(snapshot, 0)["grad_norm"] == read_metadata(snapshot)[0].grad_norm
