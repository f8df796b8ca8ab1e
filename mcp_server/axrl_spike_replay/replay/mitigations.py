"""Named replay-only mitigations: parsed from `NAME=VALUE` or YAML, validated, normalised, applied.

Each mitigation is off unless named in a config. A config is a mapping {name: value}; its normal
form has sorted names and typed values, so two spellings of one config compare equal. Applying a
config changes the replayed loss (`LossConfig`), the routing (`RoutingConfig`) or the weights the
replay starts from (`initial_model`); the training path is never touched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.policy_loss import LOGPROB_BASES, LOSS_AGG_MODES, LossConfig, RatioOutlierMask
from axrl_spike_replay.training.routing_replay import ROUTING_REPLAY_MODES, RoutingConfig
from axrl_spike_replay.untrusted_yaml import load_untrusted_yaml, read_untrusted_yaml

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


@dataclass(frozen=True)
class Mitigation:
    """One named knob: what it changes (`loss`, `routing` or `weights`), its values and what it does."""

    name: str
    target: str
    values: str
    doc: str
    parse: Callable[[str, Any], Any]
    bare: Any = None  # value when given as a bare `NAME`; None: a value is required


def _number(name: str, raw: Any) -> float:
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


def _positive(name: str, raw: Any) -> float:
    value = _number(name, raw)
    if value <= 0:
        raise ConfigError(f"mitigation {name}: must be > 0, got {shown(raw)}")
    return value


def _non_negative(name: str, raw: Any) -> float:
    value = _number(name, raw)
    if value < 0:
        raise ConfigError(f"mitigation {name}: must be >= 0, got {shown(raw)}")
    return value


def _above_one(name: str, raw: Any) -> float:
    value = _number(name, raw)
    if value <= 1:
        raise ConfigError(f"mitigation {name}: must be > 1, got {shown(raw)}")
    return value


def _choice(options: Sequence[str]) -> Callable[[str, Any], str]:
    def parse(name: str, raw: Any) -> str:
        text = str(raw).strip() if isinstance(raw, str) else raw
        if text not in options:
            raise ConfigError(f"mitigation {name}: must be one of {', '.join(options)}; got {shown(raw)}")
        return str(text)

    return parse


def _flag(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
        return raw.strip().lower() in _TRUE
    raise ConfigError(f"mitigation {name}: expected true or false, got {shown(raw)}")


def _layers(name: str, raw: Any) -> list[int]:
    items: Sequence[Any]
    if isinstance(raw, str):
        items = [part for part in re.split(r"[,\s]+", raw.strip().strip("[]")) if part]
    elif isinstance(raw, int) and not isinstance(raw, bool):
        items = [raw]
    elif isinstance(raw, (list, tuple)):
        items = raw
    else:
        raise ConfigError(f"mitigation {name}: expected MoE layer ids such as 1 or 0,1, got {shown(raw)}")
    layers = set()
    for item in items:
        try:
            layer = int(str(item).strip()) if not isinstance(item, bool) else -1
        except ValueError:
            layer = -1
        if layer < 0:
            raise ConfigError(f"mitigation {name}: {shown(item)} is not a layer id (an integer >= 0)")
        layers.add(layer)
    if not layers:
        raise ConfigError(f"mitigation {name}: name at least one MoE layer id")
    return sorted(layers)


def _path(name: str, raw: Any) -> str:
    if not isinstance(raw, (str, os.PathLike)) or not str(raw).strip():
        raise ConfigError(f"mitigation {name}: expected a path to a checkpoint or snapshot directory, got {shown(raw)}")
    return os.path.abspath(os.path.expanduser(str(raw).strip()))


_MASK_KEYS = tuple(f.name for f in dataclasses.fields(RatioOutlierMask))


def _ratio_mask(name: str, raw: Any) -> dict[str, Any]:
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
        "level": _choice(("token", "sequence"))(f"{name}.level", doc.get("level", defaults.level)),
        "low": _non_negative(f"{name}.low", doc.get("low", defaults.low)),
        "high": _positive(f"{name}.high", doc.get("high", defaults.high)),
        "base": _choice(LOGPROB_BASES)(f"{name}.base", doc.get("base", defaults.base)),
    }
    try:
        RatioOutlierMask(**spec)
    except ConfigError as exc:
        raise ConfigError(f"mitigation {name}: {exc}") from None
    return dict(sorted(spec.items()))


def _m(name: str, target: str, values: str, doc: str, parse: Callable[[str, Any], Any], bare: Any = None) -> Mitigation:
    return Mitigation(name=name, target=target, values=values, doc=doc, parse=parse, bare=bare)


MITIGATIONS: dict[str, Mitigation] = {
    m.name: m
    for m in (
        _m(
            "mismatch_token_clip_max",
            "loss",
            "float C > 0",
            "truncated importance sampling against the rollout engine: per-token loss weighted by "
            "min(exp(old - rollout), C), ratio taken against the old logprobs",
            _positive,
        ),
        _m(
            "ratio_outlier_mask",
            "loss",
            "true | token | sequence | {level, low, high, base}",
            "mask tokens (or whole sequences, by the geometric mean) whose importance ratio against the rollout "
            "(or old) logprobs leaves [low, high]; defaults level=token low=0.5 high=2.0 base=rollout",
            _ratio_mask,
            bare=True,
        ),
        _m("advantage_clip", "loss", "float A > 0", "clamp advantages to [-A, A]", _positive),
        _m(
            "log_ratio_clip",
            "loss",
            "float c > 0",
            "clamp the policy log-ratio to [-c, c] before exponentiating",
            _positive,
        ),
        _m(
            "loss_agg_mode",
            "loss",
            " | ".join(LOSS_AGG_MODES),
            "how per-token losses reduce to the rank's loss (the denominator)",
            _choice(LOSS_AGG_MODES),
        ),
        _m(
            "is_base_logprobs",
            "loss",
            " | ".join(LOGPROB_BASES),
            "which logprobs the PPO ratio is taken against",
            _choice(LOGPROB_BASES),
        ),
        _m("clip_eps_low", "loss", "float >= 0", "PPO clip range below 1 (ratio >= 1 - eps)", _non_negative),
        _m("clip_eps_high", "loss", "float >= 0", "PPO clip range above 1 (ratio <= 1 + eps)", _non_negative),
        _m("dual_clip_c", "loss", "float > 1", "dual clip: negative-advantage loss capped at -A * c", _above_one),
        _m("kl_coef", "loss", "float >= 0", "weight of the k3 KL penalty against the reference policy", _non_negative),
        _m("entropy_coef", "loss", "float >= 0", "weight of the entropy bonus", _non_negative),
        _m("aux_loss_coef", "loss", "float >= 0", "weight of the MoE load-balancing loss", _non_negative),
        _m("z_loss_coef", "loss", "float >= 0", "weight of the router z-loss", _non_negative),
        _m(
            "routing_replay",
            "routing",
            " | ".join(ROUTING_REPLAY_MODES),
            "replay recorded expert routes on all tokens, on loss tokens only (current routing elsewhere), or off",
            _choice(ROUTING_REPLAY_MODES),
        ),
        _m(
            "current_routing_layers",
            "routing",
            "MoE layer ids, e.g. 1 or 0,1",
            "these MoE layers route on current scores while the others replay the recorded routes",
            _layers,
        ),
        _m(
            "balance_negative_advantages",
            "loss",
            "true | false",
            "scale negative advantages so their total magnitude matches the positives'",
            _flag,
            bare=True,
        ),
        _m(
            "initial_model",
            "weights",
            "path to a DCP checkpoint dir or a snapshot dir",
            "replay from other weights (e.g. the run's initial model) instead of the snapshot's",
            _path,
        ),
    )
}
LOSS_FIELDS = {name for name, m in MITIGATIONS.items() if m.target == "loss"}


def valid_mitigations() -> str:
    """`name (values)` for every mitigation, one per line, for error messages and help."""
    return "\n".join(f"  {m.name} ({m.values}): {m.doc}" for m in MITIGATIONS.values())


def _lookup(name: str) -> Mitigation:
    key = str(name).strip()
    if key not in MITIGATIONS:
        raise ConfigError(f"unknown mitigation {shown(key)}; valid mitigations:\n{valid_mitigations()}")
    return MITIGATIONS[key]


def parse_config(doc: Mapping[str, Any], source: str = "mitigation config") -> dict[str, Any]:
    """A config mapping {name: value} in normal form (sorted names, typed values); ConfigError on bad input."""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: expected a mapping of mitigation names to values, got {shown(doc)}")
    out: dict[str, Any] = {}
    for name, raw in doc.items():
        mitigation = _lookup(name)
        if raw is None:
            if mitigation.bare is None:
                raise ConfigError(f"{source}: mitigation {mitigation.name} needs a value ({mitigation.values})")
            raw = mitigation.bare
        out[mitigation.name] = mitigation.parse(mitigation.name, raw)
    if out.get("balance_negative_advantages") is False:
        del out["balance_negative_advantages"]  # false is the default: off
    return dict(sorted(out.items()))


def parse_mitigation_args(items: Sequence[str]) -> dict[str, Any]:
    """One config from CLI `NAME[=VALUE]` items (each name at most once)."""
    doc: dict[str, Any] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        name = name.strip()
        if name in doc:
            raise ConfigError(
                f"`mitigations` {name} is given twice; give each mitigation once per config", "mitigations"
            )
        mitigation = _lookup(name)
        if not sep and mitigation.bare is None:
            raise ConfigError(f"`mitigations` {name} needs a value: {name}=VALUE ({mitigation.values})", "mitigations")
        doc[name] = value if sep else None
    return parse_config(doc, "--mitigation")


def load_mitigation_set(path: str | Path) -> list[dict[str, Any]]:
    """The configs of a mitigation-set YAML file: a list of {NAME: VALUE, ...} mappings, normalised.

    The file is untrusted YAML (no aliases, bounded size); errors name it and never echo it whole.
    """
    file = Path(path)
    try:
        is_file = file.is_file()  # a FIFO or device would block or never end
        file.stat()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read mitigation set ({exc.strerror or exc})") from None
    if not is_file:
        raise ConfigError(f"{file}: cannot read mitigation set (not a regular file)")
    doc = read_untrusted_yaml(file, "mitigation set")
    if not isinstance(doc, list) or not doc:
        raise ConfigError(
            f"mitigation set {file}: expected a non-empty list of mitigation configs such as - {{advantage_clip: 1.0}}"
        )
    return [parse_config(item or {}, f"mitigation set {file} config {i + 1}") for i, item in enumerate(doc)]


def check_distinct(configs: Sequence[Mapping[str, Any]]) -> None:
    """ConfigError when a config is empty (that is the baseline) or two configs are the same."""
    seen: dict[str, int] = {}
    for i, config in enumerate(configs, start=1):
        if not config:
            raise ConfigError(f"config {i} sets no mitigation: that is the baseline, which every sweep runs anyway")
        key = config_id(config)
        if key in seen:
            raise ConfigError(f"configs {seen[key]} and {i} are the same after normalisation ({key})")
        seen[key] = i


def _slug(value: Any) -> str:
    if isinstance(value, dict):
        return "_".join(f"{k}-{_slug(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "-".join(_slug(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def config_id(config: Mapping[str, Any]) -> str:
    """A short, file-name-safe, stable id of a normalised config (`baseline` when empty)."""
    if not config:
        return "baseline"
    parts = []
    for name, value in config.items():
        if name == "initial_model":
            value = Path(str(value)).name or "root"
        elif name == "ratio_outlier_mask":
            defaults = dataclasses.asdict(RatioOutlierMask())
            value = {k: v for k, v in value.items() if v != defaults[k]} or True
        parts.append(name if value is True else f"{name}={_slug(value)}")
    text = re.sub(r"[^A-Za-z0-9._=+-]+", "-", "+".join(parts)).strip("-")
    if len(text) > 80:
        digest = hashlib.sha256(repr(sorted(config.items())).encode()).hexdigest()[:10]
        text = f"{text[:68]}~{digest}"
    return text


@dataclass(frozen=True)
class AppliedConfig:
    """A config applied to the saved setup: the loss, routing and weights the replay runs with."""

    config_id: str
    mitigations: dict[str, Any]
    loss: LossConfig
    routing: RoutingConfig
    weights: str | None  # None: the snapshot's own weights

    @property
    def forward_key(self) -> tuple[RoutingConfig, str | None]:
        """Configs with equal keys share one forward pass (they differ in the loss only)."""
        return (self.routing, self.weights)

    @property
    def needs_entropy(self) -> bool:
        return bool(self.loss.entropy_coef)


def apply_config(config: Mapping[str, Any], loss: LossConfig, routing: RoutingConfig) -> AppliedConfig:
    """The saved loss/routing with a normalised config's mitigations applied."""
    changes = {name: value for name, value in config.items() if name in LOSS_FIELDS}
    if "ratio_outlier_mask" in changes:
        changes["ratio_outlier_mask"] = RatioOutlierMask(**changes["ratio_outlier_mask"])
    new_loss = dataclasses.replace(loss, **changes) if changes else loss
    new_routing = routing
    if "routing_replay" in config:
        new_routing = dataclasses.replace(new_routing, replay=config["routing_replay"])
    if "current_routing_layers" in config:
        new_routing = dataclasses.replace(new_routing, current_routing_layers=tuple(config["current_routing_layers"]))
    return AppliedConfig(
        config_id=config_id(config),
        mitigations=dict(config),
        loss=new_loss,
        routing=new_routing,
        weights=config.get("initial_model"),
    )


def mitigation_args(config: Mapping[str, Any]) -> list[str]:
    """`NAME=VALUE` items that parse back to `config` (for command lines)."""
    items = []
    for name, value in config.items():
        if isinstance(value, dict):
            text = ",".join(f"{k}:{v}" for k, v in value.items())
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            text = str(value).lower()
        else:
            text = str(value)
        items.append(f"{name}={text}")
    return items
