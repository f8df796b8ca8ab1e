"""The values a mitigation takes: each `parse_*` checks type and range (a `ConfigError` naming the mitigation),
each `apply_*` sets the normal-form value on a `ReplaySetup`, each `*_id` says how the value shows in a config id."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigation_declaration import ReplaySetup
from axrl_spike_replay.experiment.mitigation.recompute import recompute_of
from axrl_spike_replay.training.loss_config import (
    LOGPROB_BASES,
    RatioOutlierMask,
)
from axrl_spike_replay.training.sample_masks import SCOPES, pairs_of
from axrl_spike_replay.untrusted.untrusted_yaml import load_untrusted_yaml

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def parse_number(name: str, raw: Any) -> float:
    if isinstance(raw, bool):
        raise ConfigError(f"mitigation {name}: expected a number, got {shown(raw)}")
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise ConfigError(f"mitigation {name}: expected a number, got {shown(raw)}") from None
    else:
        raise ConfigError(f"mitigation {name}: expected a number, got {type(raw).__name__} {shown(raw)}")
    if not math.isfinite(value):
        raise ConfigError(f"mitigation {name}: expected a finite number, got {shown(raw)}")
    return value


def parse_positive(name: str, raw: Any) -> float:
    value = parse_number(name, raw)
    if value <= 0:
        raise ConfigError(f"mitigation {name}: must be > 0, got {shown(raw)}")
    return value


def parse_non_negative(name: str, raw: Any) -> float:
    value = parse_number(name, raw)
    if value < 0:
        raise ConfigError(f"mitigation {name}: must be >= 0, got {shown(raw)}")
    return value


def parse_above_one(name: str, raw: Any) -> float:
    value = parse_number(name, raw)
    if value <= 1:
        raise ConfigError(f"mitigation {name}: must be > 1, got {shown(raw)}")
    return value


def parse_choice(options: Sequence[str]) -> Callable[[str, Any], str]:
    def parse(name: str, raw: Any) -> str:
        text = str(raw).strip() if isinstance(raw, str) else raw
        if text not in options:
            raise ConfigError(f"mitigation {name}: must be one of {', '.join(options)}; got {shown(raw)}")
        return str(text)

    return parse


def parse_flag(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
        return raw.strip().lower() in _TRUE
    raise ConfigError(f"mitigation {name}: expected true or false, got {shown(raw)}")


FIRST_MOE_LAYER = "first"  # `current_routing_layers: first`: the model's first MoE layer, resolved when applied


def _names_first(item: Any) -> bool:
    return isinstance(item, str) and item.strip().strip("[]").strip().lower() == FIRST_MOE_LAYER


def parse_layers(name: str, raw: Any) -> list[int] | str:
    """Absolute layer ids as a sorted list, or `first` (alone: it cannot be mixed with ids)."""
    items: Sequence[Any]
    if _names_first(raw) or (isinstance(raw, (list, tuple)) and len(raw) == 1 and _names_first(raw[0])):
        return FIRST_MOE_LAYER
    if isinstance(raw, str):
        items = [part for part in re.split(r"[,\s]+", raw.strip().strip("[]")) if part]
    elif isinstance(raw, int) and not isinstance(raw, bool):
        items = [raw]
    elif isinstance(raw, (list, tuple)):
        items = raw
    else:
        raise ConfigError(f"mitigation {name}: expected MoE layer ids such as 1 or 0,1, or first, got {shown(raw)}")
    layers = set()
    for item in items:
        if _names_first(item):
            raise ConfigError(f"mitigation {name}: {FIRST_MOE_LAYER} stands alone; to add other layers, name their ids")
        try:
            layer = int(str(item).strip()) if not isinstance(item, bool) else -1
        except ValueError:
            layer = -1
        if layer < 0:
            raise ConfigError(
                f"mitigation {name}: {shown(item)} is not a layer id (an integer >= 0) nor {FIRST_MOE_LAYER}"
            )
        layers.add(layer)
    if not layers:
        raise ConfigError(f"mitigation {name}: name at least one MoE layer id")
    return sorted(layers)


def parse_path(name: str, raw: Any) -> str:
    if not isinstance(raw, (str, os.PathLike)) or not str(raw).strip():
        raise ConfigError(f"mitigation {name}: expected a path to a checkpoint or snapshot directory, got {shown(raw)}")
    return os.path.abspath(os.path.expanduser(str(raw).strip()))


_MASK_KEYS = tuple(f.name for f in dataclasses.fields(RatioOutlierMask))


def parse_ratio_mask(name: str, raw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if raw is False or (isinstance(raw, str) and raw.strip().lower() in _FALSE):
        raise ConfigError(f"mitigation {name}: to leave it off, do not name it")
    if raw is True or (isinstance(raw, str) and raw.strip().lower() in _TRUE):
        pass  # the defaults
    elif isinstance(raw, str) and raw.strip() in ("token", "sequence"):
        doc = {"level": raw.strip()}
    elif isinstance(raw, str):
        text = raw.strip()
        if text.startswith("{"):
            loaded = load_untrusted_yaml(text, f"mitigation {name}")
            if not isinstance(loaded, dict):
                raise ConfigError(f"mitigation {name}: {shown(raw)} is not a mapping")
            doc = loaded
        else:
            for part in filter(None, (p.strip() for p in text.split(","))):
                key, sep, value = part.partition(":")
                if not sep:
                    raise ConfigError(
                        f"mitigation {name}: {shown(part)} is not KEY:VALUE (keys: {', '.join(_MASK_KEYS)})"
                    )
                doc[key.strip()] = value.strip()
    elif isinstance(raw, Mapping):
        doc = dict(raw)
    else:
        raise ConfigError(f"mitigation {name}: expected true, token, sequence or a mapping, got {shown(raw)}")
    unknown = sorted(str(key) for key in set(doc) - set(_MASK_KEYS))
    if unknown:
        raise ConfigError(f"mitigation {name}: unknown keys {shown(unknown)} (known: {', '.join(_MASK_KEYS)})")
    defaults = RatioOutlierMask()
    spec = {
        "level": parse_choice(("token", "sequence"))(f"{name}.level", doc.get("level", defaults.level)),
        "low": parse_non_negative(f"{name}.low", doc.get("low", defaults.low)),
        "high": parse_positive(f"{name}.high", doc.get("high", defaults.high)),
        "base": parse_choice(LOGPROB_BASES)(f"{name}.base", doc.get("base", defaults.base)),
    }
    try:
        RatioOutlierMask(**spec)
    except ConfigError as exc:
        raise ConfigError(f"mitigation {name}: {exc}") from None
    return dict(sorted(spec.items()))


def set_loss(field_name: str, convert: Callable[[Any], Any] = float) -> Callable[[ReplaySetup, Any], ReplaySetup]:
    """Set one `LossConfig` field (numbers as floats, as the run config has them)."""

    def apply(setup: ReplaySetup, value: Any) -> ReplaySetup:
        return dataclasses.replace(setup, loss=dataclasses.replace(setup.loss, **{field_name: convert(value)}))

    return apply


def apply_ratio_mask(setup: ReplaySetup, value: Any) -> ReplaySetup:
    low, high = float(value["low"]), float(value["high"])
    mask = RatioOutlierMask(level=value["level"], low=low, high=high, base=value["base"])
    return dataclasses.replace(setup, loss=dataclasses.replace(setup.loss, ratio_outlier_mask=mask))


def apply_routing_replay(setup: ReplaySetup, value: Any) -> ReplaySetup:
    return dataclasses.replace(setup, routing=dataclasses.replace(setup.routing, replay=str(value)))


def resolve_layers(value: Any, moe_layers: Sequence[int]) -> tuple[int, ...]:
    """The absolute layer ids of a `current_routing_layers` value: `first` is the lowest of `moe_layers`."""
    if value != FIRST_MOE_LAYER:
        return tuple(int(v) for v in value)
    if not moe_layers:
        raise ConfigError(
            f"current_routing_layers={FIRST_MOE_LAYER} names the model's first MoE layer, and the model has none"
            " (or was not given)"
        )
    return (min(moe_layers),)


def apply_current_routing_layers(setup: ReplaySetup, value: Any) -> ReplaySetup:
    layers = resolve_layers(value, setup.moe_layers)
    return dataclasses.replace(setup, routing=dataclasses.replace(setup.routing, current_routing_layers=layers))


def apply_initial_model(setup: ReplaySetup, value: Any) -> ReplaySetup:
    return dataclasses.replace(setup, weights=str(value))


_OUTLIER_KEYS = ("scope", "threshold")


def parse_advantage_outlier(name: str, raw: Any) -> dict[str, Any]:
    """`T`, `T,scope:group`, `{threshold: T, scope: group}` -> {scope, threshold} (threshold > 0)."""
    doc: dict[str, Any]
    if isinstance(raw, Mapping):
        doc = dict(raw)
    elif isinstance(raw, str) and ":" in raw:
        doc = {}
        for part in filter(None, (p.strip() for p in raw.split(","))):
            key, sep, value = part.partition(":")
            if not sep:
                doc["threshold"] = part
                continue
            doc[key.strip()] = value.strip()
    else:
        doc = {"threshold": raw}
    unknown = sorted(str(key) for key in set(doc) - set(_OUTLIER_KEYS))
    if unknown:
        raise ConfigError(f"mitigation {name}: unknown keys {shown(unknown)} (known: {', '.join(_OUTLIER_KEYS)})")
    if "threshold" not in doc:
        raise ConfigError(f"mitigation {name}: give the threshold, e.g. {name}=5")
    return {
        "scope": parse_choice(SCOPES)(f"{name}.scope", doc.get("scope", "batch")),
        "threshold": parse_positive(f"{name}.threshold", doc["threshold"]),
    }


def apply_advantage_outlier(setup: ReplaySetup, value: Any) -> ReplaySetup:
    samples = dataclasses.replace(
        setup.samples, outlier_threshold=float(value["threshold"]), outlier_scope=str(value["scope"])
    )
    return dataclasses.replace(setup, samples=samples)


def apply_drop_samples(setup: ReplaySetup, value: Any) -> ReplaySetup:
    return dataclasses.replace(setup, samples=dataclasses.replace(setup.samples, drop=pairs_of(value)))


def apply_drop_ranks(setup: ReplaySetup, value: Any) -> ReplaySetup:
    ranks = frozenset(int(v) for v in value)
    return dataclasses.replace(setup, samples=dataclasses.replace(setup.samples, drop_ranks=ranks))


def apply_keep_ranks(setup: ReplaySetup, value: Any) -> ReplaySetup:
    ranks = frozenset(int(v) for v in value)
    return dataclasses.replace(setup, samples=dataclasses.replace(setup.samples, keep_ranks=ranks))


def apply_recompute(setup: ReplaySetup, value: Any) -> ReplaySetup:
    return dataclasses.replace(setup, recompute=recompute_of(value))


def ranks_id(value: Any) -> Any:
    """Saved ranks as typed: `0,2`."""
    return ",".join(str(v) for v in value)


def recompute_id(value: Any) -> Any:
    """The recompute items as typed: `old_logprobs:rank1,routes:rank1`."""
    return ",".join(str(v) for v in value)


def outlier_id(value: Any) -> Any:
    """The threshold, with `,scope:group` where the scope is not the batch (as typed)."""
    return value["threshold"] if value.get("scope") == "batch" else f"{number_id(value['threshold'])},scope:group"


def pairs_id(value: Any) -> Any:
    """Samples as typed: `1:4,1:5`."""
    return ",".join(str(v) for v in value)


def mask_id(value: Any) -> Any:
    """Only the keys that differ from the defaults, as typed (`level:sequence,high:3`); a mask with all defaults is
    just the name."""
    defaults = dataclasses.asdict(RatioOutlierMask())
    changed = [f"{k}:{number_id(v) if isinstance(v, float) else v}" for k, v in value.items() if v != defaults[k]]
    return ",".join(changed) or True


def number_id(value: float) -> str:
    """A float as text that parses back to it: a whole one without `.0`, no `+` in an exponent (`1e16`)."""
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value).replace("e+", "e")


def path_id(value: Any) -> Any:
    return Path(str(value)).name or "root"
