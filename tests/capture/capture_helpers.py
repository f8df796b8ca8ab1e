"""Recompute a snapshot's step with `training.rank_step` (what a baseline or mitigated replay does), in one process."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import yaml

from axrl_spike_replay.models.tiny_moe import TinyMoEConfig, TinyMoEPolicy
from axrl_spike_replay.snapshot.dcp.checkpoint import load_model_state
from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_routing_payload
from axrl_spike_replay.training.policy_loss import LossConfig
from axrl_spike_replay.training.rank_step import (
    global_grad_norm,
    rank_forward_backward,
    reduce_gradients,
)
from axrl_spike_replay.training.routing_replay import RoutingConfig, routing_control


def recompute_grad_norm(snapshot: Path, **loss_changes: Any) -> float:
    """Global grad norm of the snapshot's step, every saved rank summed here, with LossConfig changes applied."""
    cfg = yaml.safe_load((snapshot / "run_config.yaml").read_text())
    model = TinyMoEPolicy(TinyMoEConfig.from_dict(cfg["model"]))
    state = model.state_dict()
    load_model_state(snapshot, state)
    model.load_state_dict(state)
    loss_cfg = dataclasses.replace(LossConfig.from_dict(cfg["loss"]), **loss_changes)
    routing = RoutingConfig.from_dict(cfg["routing"])
    world_size = cfg["parallel"]["world_size"]
    for rank in range(world_size):
        batch = load_rank_batch(snapshot, rank)
        control = routing_control(routing, batch, load_routing_payload(snapshot, rank).routed_experts)
        rank_forward_backward(model, batch, loss_cfg, control)
    reduce_gradients(model, world_size)
    return global_grad_norm(model)


def final_weights_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """L2 distance between two state dicts."""
    return sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
