"""The parameters each built-in fault of `capture.fault_injection.faults` takes, and the rule each value must meet:
checked when a spec is parsed (`faults.make_fault`), so a bad one is refused before any training step, never at the
burst."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

MAX_SHIFT = 65536  # positions: beyond any sequence the reference trainer makes
MAX_SCALE = 1e9  # factors, offsets and penalties: finite, and far from overflowing a float32 reward
MAX_LAYERS = 1024
STORED_SIGNALS = ("old_logprobs", "ref_logprobs")
ParamRule = Callable[[Any], str | None]  # None: the value is good; else what is wrong with it


def whole(lo: int, hi: int) -> ParamRule:
    """An integer (not a bool) from `lo` to `hi`."""

    def rule(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        return None if ok else f"must be a whole number from {lo} to {hi}"

    return rule


def number(lo: float, hi: float) -> ParamRule:
    """A finite number from `lo` to `hi`."""

    def rule(value: Any) -> str | None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok and lo <= value <= hi else f"must be a number from {lo:g} to {hi:g}"

    return rule


def one_of(*names: str) -> ParamRule:
    """One of `names`."""
    return lambda value: None if value in names else f"must be one of {', '.join(names)}"


def flag(value: Any) -> str | None:
    """true or false."""
    return None if isinstance(value, bool) else "must be true or false"


def layer_list(value: Any) -> str | None:
    """None, or a non-empty list of MoE layer indexes."""
    index = whole(0, MAX_LAYERS - 1)
    ok = value is None or (isinstance(value, list) and 0 < len(value) <= MAX_LAYERS and not any(map(index, value)))
    return None if ok else f"must be a list of MoE layer indexes from 0 to {MAX_LAYERS - 1}"


SHIFT = {"shift": whole(1, MAX_SHIFT)}
BY = {"by": whole(-MAX_SHIFT, MAX_SHIFT)}
FRACTION = {"fraction": number(0.0, 1.0)}
SIGNAL = {"signal": one_of(*STORED_SIGNALS)}


def check_params(kind: str, params: dict[str, Any], rules: dict[str, ParamRule]) -> None:
    """ConfigError naming the first parameter of a `kind` fault that it does not take or whose value is wrong."""
    unknown = sorted(set(params) - set(rules), key=str)
    if unknown:
        known = ", ".join(rules) or "none"
        raise ConfigError(f"fault {kind}: unknown params {shown(unknown, 80)} (known: {known})")
    for name, value in params.items():
        wrong = rules[name](value)
        if wrong is not None:
            raise ConfigError(f"fault {kind}: `params.{name}` {wrong}, got {shown(value, 80)}")
