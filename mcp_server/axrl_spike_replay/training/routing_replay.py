"""Routing replay (R3): which recorded routes the training forward is forced to take, per the `routing:` config."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.tiny_moe import RoutingControl

ROUTING_REPLAY_MODES = ("off", "all", "loss_tokens")


@dataclass(frozen=True)
class RoutingConfig:
    """`routing:` section: replay recorded routes (R3) on all tokens, loss tokens only, or not at all."""

    replay: str = "off"
    current_routing_layers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.replay not in ROUTING_REPLAY_MODES:
            raise ConfigError(f"routing.replay must be one of {ROUTING_REPLAY_MODES}, got {self.replay!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"replay": self.replay, "current_routing_layers": list(self.current_routing_layers)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], section: str = "routing") -> RoutingConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"{section}: unknown keys {unknown} (known: {sorted(known)})")
        values = dict(doc)
        if "current_routing_layers" in values:
            values["current_routing_layers"] = tuple(int(x) for x in values["current_routing_layers"] or ())
        return cls(**values)


def routing_control(
    cfg: RoutingConfig, batch: dict[str, torch.Tensor], routed_experts: torch.Tensor | None
) -> RoutingControl:
    """The forward's routing for a batch, given the config and the rank's recorded routes."""
    if cfg.replay == "off":
        return RoutingControl(current_layers=frozenset(cfg.current_routing_layers))
    if routed_experts is None:
        raise ConfigError(f"routing.replay={cfg.replay!r} needs a routing payload, and this rank has none")
    replay_tokens = batch["loss_mask"] > 0 if cfg.replay == "loss_tokens" else None
    return RoutingControl(
        routes=routed_experts.long(),
        replay_tokens=replay_tokens,
        current_layers=frozenset(cfg.current_routing_layers),
    )
