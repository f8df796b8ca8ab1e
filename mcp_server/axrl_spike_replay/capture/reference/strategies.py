"""The reference trainer's data-parallel strategies (a light module: the CLI imports it to list choices)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PARALLEL_STRATEGIES = ("ddp", "fsdp")  # ddp: replicated weights, all-reduced grads; fsdp: FSDP2 fully_shard


def parallel_strategy(config: Mapping[str, Any]) -> str:
    """The run config's `parallel.strategy` (absent: ddp, as every snapshot before FSDP capture)."""
    section = config.get("parallel")
    strategy = section.get("strategy", "ddp") if isinstance(section, Mapping) else "ddp"
    return strategy if strategy in PARALLEL_STRATEGIES else "ddp"
