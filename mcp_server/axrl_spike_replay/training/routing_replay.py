"""Routing replay (R3): which recorded routes the training forward is forced to take, per the `routing:` config."""

from __future__ import annotations

import torch

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.training.routing_config import RoutingConfig


def routing_control(
    cfg: RoutingConfig, batch: dict[str, torch.Tensor], routed_experts: torch.Tensor | None
) -> RoutingControl:
    """The forward's routing for a batch, given the config and the rank's recorded routes."""
    if cfg.replay == "off":
        return RoutingControl(current_layers=frozenset(cfg.current_routing_layers))
    if routed_experts is None:
        raise ConfigError(f"routing.replay={shown(cfg.replay, 60)} needs a routing payload, and this rank has none")
    replay_tokens = batch["loss_mask"] > 0 if cfg.replay == "loss_tokens" else None
    return RoutingControl(
        routes=routed_experts.long(),
        replay_tokens=replay_tokens,
        current_layers=frozenset(cfg.current_routing_layers),
    )
