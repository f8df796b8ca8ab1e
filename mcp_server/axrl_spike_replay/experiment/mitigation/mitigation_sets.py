"""Named sets of mitigation configs: the default sweep, and the methods the seed workflow records."""

from __future__ import annotations

from typing import Any

from axrl_spike_replay.experiment.mitigation.mitigations import FIRST_MOE_LAYER

# The methods the seed workflow asks to try on every spike; `routing_replay=off` is diagnostic only. Each config
# must apply to every model: `first` is each model's own first MoE layer (layer 0 is dense on deepseek_v3).
SEED_WORKFLOW_METHODS: dict[str, dict[str, Any]] = {
    "token-mismatch-tis-clip-2": {"mismatch_token_clip_max": 2.0},
    "current-routing-first-moe-layer": {"current_routing_layers": FIRST_MOE_LAYER},
    "routing-replay-loss-tokens-only": {"routing_replay": "loss_tokens"},
    "balance-negative-advantages": {"balance_negative_advantages": True},
    "routing-replay-off-diagnostic": {"routing_replay": "off"},
}

# A first sweep: the seed workflow's methods plus the classic loss-level guards.
DEFAULT_SWEEP: list[dict[str, Any]] = [
    *SEED_WORKFLOW_METHODS.values(),
    {"is_base_logprobs": "old"},
    {"dual_clip_c": 3.0},
    {"log_ratio_clip": 1.0},
    {"ratio_outlier_mask": {"level": "token", "low": 0.5, "high": 2.0, "base": "rollout"}},
    {"advantage_clip": 1.0},
]

DIAGNOSTIC_ONLY = frozenset({"routing-replay-off-diagnostic"})
