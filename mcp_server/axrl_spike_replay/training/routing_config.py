"""The `routing:` section of a run: routing replay (R3) mode and the MoE layers that route on current scores.
Torch-free, like `loss_config`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError

ROUTING_REPLAY_MODES = ("off", "all", "loss_tokens")


@dataclass(frozen=True)
class RoutingConfig:
    """`routing:` section: replay recorded routes (R3) on all tokens, loss tokens only, or not at all."""

    replay: str = "off"
    current_routing_layers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.replay not in ROUTING_REPLAY_MODES:
            raise ConfigError(f"routing.replay must be one of {ROUTING_REPLAY_MODES}, got {shown(self.replay, 60)}")

    def to_dict(self) -> dict[str, Any]:
        return {"replay": self.replay, "current_routing_layers": list(self.current_routing_layers)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], section: str = "routing") -> RoutingConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"{section}: unknown keys {shown_names(unknown)} (known: {sorted(known)})")
        values = dict(doc)
        if "current_routing_layers" in values:
            values["current_routing_layers"] = tuple(int(x) for x in values["current_routing_layers"] or ())
        return cls(**values)
