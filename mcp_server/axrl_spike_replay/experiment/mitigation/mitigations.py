"""Named replay-only mitigations, each declared once in `MITIGATIONS` (`experiment.mitigation.mitigation_table`; what a
declaration holds: `mitigation_declaration`; the values they take: `mitigation_values`): parsed from `NAME=VALUE`
or YAML, validated, normalised, applied.

A mitigation's declaration holds everything about it: its name, what it changes, its accepted values
in words, its parser (value type and range), what it does, when to try it, and the function that
applies it to the replay's loss (`LossConfig`), routing (`RoutingConfig`) or starting weights. The
server's tool descriptions, `axrl://mitigations`, the skill's mitigation catalogue and docs/mitigations.md
are all generated from it (`experiment/mitigation/mitigation_catalogue.py`, `scripts/render_mitigation_catalogue.py`),
and so is what each trainer sets to make the same change in training (`settings`, see
`experiment/mitigation/trainer_settings.py`).
Torch-free: the server imports this module to describe its tools.

Each mitigation is off unless named in a config. A config is a mapping {name: value}; its one normal
form (`normal_form`, what `parse_config` returns) has sorted names and typed values, so two spellings of
one config compare equal; the task record and the method files keep that form, and its hash
(`workspace.task_record.changes.config_key`) is taken over `canonical` values, so 2 and 2.0 hash alike.
The training path is never touched.

Layer ids are absolute decoder layers. `current_routing_layers: first` names the model's first MoE layer
without knowing the model: its normal form is the text `first` (so `first`, `[first]` and `FIRST` hash alike,
and never like an id list: on deepseek_v3 it means layer 1, elsewhere usually 0). `apply_config` resolves it
against the snapshot's model; `AppliedConfig.resolved` holds the ids used, which results record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigation_declaration import SYMPTOMS, Advice, Mitigation, ReplaySetup
from axrl_spike_replay.experiment.mitigation.mitigation_table import MITIGATIONS
from axrl_spike_replay.experiment.mitigation.mitigation_values import (
    FIRST_MOE_LAYER,
    number_id,
    ranks_id,
    resolve_layers,
)
from axrl_spike_replay.experiment.mitigation.objective_mitigations import refuse_unread_dual_clip
from axrl_spike_replay.experiment.mitigation.rank_scope import (
    REQUIRED,
    SEPARATOR,
    check_hypothesis,
    hypothesis_text,
    is_hypothesis,
    is_scoped,
    scope_error,
    scope_text,
    split_scope,
)
from axrl_spike_replay.experiment.mitigation.recompute import Recompute
from axrl_spike_replay.training.loss_config import (
    LossConfig,
)
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.training.sample_masks import SampleFilter, parse_ranks
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

__all__ = ["FIRST_MOE_LAYER", "MITIGATIONS", "SYMPTOMS", "Advice", "Mitigation", "ReplaySetup", "resolve_layers"]


def valid_mitigations(docs: bool = True) -> str:
    """`name (values): doc` for every mitigation, one per line, for help; without `docs`, `name (values)` only (an
    error names what is valid; the docs are in the catalogue and the help)."""
    if not docs:
        return "\n".join(f"  {m.name} ({m.values})" for m in MITIGATIONS.values())
    return "\n".join(f"  {m.name} ({m.values}): {m.doc}" for m in MITIGATIONS.values())


def _lookup(name: str) -> Mitigation:
    key = str(name).strip()
    if key not in MITIGATIONS:
        raise ConfigError(f"unknown mitigation {shown(key)}; valid mitigations:\n{valid_mitigations(docs=False)}")
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
        out[mitigation.name] = _parse_value(mitigation, raw)
    if out.get("balance_negative_advantages") is False:
        del out["balance_negative_advantages"]  # false is the default: off
    check_hypothesis(out, source)
    return dict(sorted(out.items()))


def _parse_value(mitigation: Mitigation, raw: Any) -> Any:
    """A raw value in normal form: the mitigation's own, or {ranks, value} when scoped to ranks (`VALUE@RANKS`)."""
    name = mitigation.name
    scope = split_scope(raw) if mitigation.target == "loss" else None
    if scope is not None and not mitigation.per_rank:
        raise scope_error(name, raw)
    if scope is None:
        if mitigation.per_rank == REQUIRED:
            raise ConfigError(
                f"mitigation {name} only has a meaning on some ranks: name them after {SEPARATOR!r}, e.g. "
                f"{name}=2{SEPARATOR}1 ({mitigation.values})",
                "mitigations",
            )
        return mitigation.parse(name, raw)
    value, ranks = scope
    return {
        "ranks": parse_ranks(f"{name} (its ranks after {SEPARATOR!r})", ranks),
        "value": mitigation.parse(name, value),
    }


_INT_RE = re.compile(r"^[+-]?\d+$")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def normal_form(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The one normal form of a config: sorted names, each known mitigation's value as its parser types it
    (numbers as floats, layers as sorted ints or `first`, a full ratio mask), unset entries dropped.

    `parse_config` returns it for the configs it validates; the task record and the method files store it,
    also for configs of older records that name something else (kept in `canonical` form).
    """
    out: dict[str, Any] = {}
    for name, raw in dict(config or {}).items():
        key = str(name).strip()
        value = canonical(raw)
        mitigation = MITIGATIONS.get(key)
        if mitigation is not None and value is not None:
            with contextlib.suppress(ConfigError):  # a record is kept as written, never refused
                value = _parse_value(mitigation, raw)
        if value is not None and value != {} and value != []:
            out[key] = value
    return dict(sorted(out.items()))


def canonical(value: Any) -> Any:
    """A value in canonical JSON form: sorted mappings without unset entries, lists for sequences, whole floats
    as ints (2.0 == "2" -> 2), "true"/"false" as booleans. What `workspace.task_record.changes.config_key` hashes, so
    equal configs hash alike however their numbers are spelled."""
    if isinstance(value, Mapping):
        items = {str(k): canonical(v) for k, v in value.items()}
        return {k: items[k] for k in sorted(items) if items[k] is not None and items[k] != {} and items[k] != []}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        if text.lower() in ("none", "null", ""):
            return None
        if _INT_RE.match(text):
            return int(text)
        if _FLOAT_RE.match(text):
            return canonical(float(text))
        return text
    return str(value)


def parse_mitigation_args(items: Sequence[str]) -> dict[str, Any]:
    """One config from CLI `NAME[=VALUE]` items (each name at most once)."""
    doc = mitigation_doc(items)
    for name, value in doc.items():
        mitigation = _lookup(name)
        if value is None and mitigation.bare is None:
            raise ConfigError(f"`mitigations` {name} needs a value: {name}=VALUE ({mitigation.values})", "mitigations")
    return parse_config(doc, "--mitigation")


def mitigation_doc(items: Sequence[str]) -> dict[str, Any]:
    """One config from CLI `NAME[=VALUE]` items as typed, {name: value} (None for a bare name), each name at most
    once; its names and values are checked where it is parsed (`parse_config`: a sweep reports a config it refuses
    beside the others)."""
    doc: dict[str, Any] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        name = name.strip()
        if name in doc:
            raise ConfigError(
                f"`mitigations` {name} is given twice; give each mitigation once per config", "mitigations"
            )
        doc[name] = value if sep else None
    return doc


def load_mitigation_set(path: str | Path) -> list[dict[str, Any]]:
    """The configs of a mitigation-set YAML file: a list of {NAME: VALUE, ...} mappings, normalised.

    The file is untrusted YAML (no aliases, bounded size); errors name it and never echo it whole.
    """
    file = Path(path)
    return [
        parse_config(item, f"mitigation set {file} config {i + 1}") for i, item in enumerate(read_mitigation_set(file))
    ]


def read_mitigation_set(path: str | Path) -> list[Any]:
    """The configs of a mitigation-set YAML file as written (an empty entry as {}), checked where they are parsed
    (`parse_config`: a sweep reports a config it refuses beside the others); ConfigError naming the file when it
    cannot be read or holds no list of configs."""
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
    return [item or {} for item in doc]


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
        return ",".join(_slug(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return number_id(value)
    return str(value)


def config_id(config: Mapping[str, Any]) -> str:
    """A short, file-name-safe, stable id of a normalised config (`baseline` when empty): its items as the CLI takes
    them (`NAME=VALUE`, `+` between), so `--mitigation` items of an id give back its config (`config_items`). Only
    an `initial_model` path (its file name stands in) and an id past 80 characters (cut, a digest added) are not
    such items."""
    if not config:
        return "baseline"
    parts = []
    for name, value in config.items():
        mitigation = MITIGATIONS.get(name)
        if is_scoped(value):
            own = (
                value["value"]
                if mitigation is None or mitigation.id_value is None
                else mitigation.id_value(value["value"])
            )
            parts.append(f"{name}={_slug(own)}{SEPARATOR}{ranks_id(value['ranks'])}")
            continue
        if mitigation is not None and mitigation.id_value is not None:
            value = mitigation.id_value(value)
        bare = value is True and (mitigation is None or mitigation.bare is not None)
        parts.append(name if bare else f"{name}={_slug(value)}")
    text = re.sub(r"[^A-Za-z0-9._=+@:,-]+", "-", "+".join(parts)).strip("-")
    if len(text) > 80:
        digest = hashlib.sha256(repr(sorted(config.items())).encode()).hexdigest()[:10]
        text = f"{text[:68]}~{digest}"
    return text


def config_items(config_id_text: str) -> list[str]:
    """The `--mitigation` items a config id is made of (`config_id`'s inverse, where it has one)."""
    return [] if config_id_text == "baseline" else config_id_text.split("+")


@dataclass(frozen=True)
class AppliedConfig:
    """A config applied to the saved setup: the loss, routing and weights the replay runs with."""

    config_id: str
    mitigations: dict[str, Any]
    loss: LossConfig
    routing: RoutingConfig
    weights: str | None  # None: the snapshot's own weights
    samples: SampleFilter = field(default_factory=SampleFilter)  # samples left out of the loss
    resolved: dict[str, Any] = field(default_factory=dict)  # values named symbolically, as resolved: {name: ids}
    recompute: Recompute = field(default_factory=Recompute)  # stored signals replaced from the snapshot's weights
    # a hypothesis (settings scoped to ranks, `experiment.mitigation.rank_scope`): the loss each named saved
    # rank computes with
    rank_losses: dict[int, LossConfig] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """How errors name this config."""
        if self.is_hypothesis:
            return f"the hypothesis {hypothesis_text(self.mitigations)}"
        return "the saved config" if not self.mitigations else f"config {self.config_id}"

    @property
    def is_hypothesis(self) -> bool:
        """Whether this config is a hypothesis about what some ranks computed (judged against the recording)."""
        return is_hypothesis(self.mitigations)

    def loss_of(self, rank: int) -> LossConfig:
        """The loss saved rank `rank` computes with: its own under a hypothesis that names it, else the config's."""
        return self.rank_losses.get(rank, self.loss)

    def losses(self) -> list[LossConfig]:
        """Every loss this config computes with: the config's, then each named rank's."""
        return [self.loss, *self.rank_losses.values()]

    @property
    def forward_key(self) -> tuple[RoutingConfig, str | None, frozenset[Any]]:
        """Configs with equal keys share one forward pass (they differ in the loss only)."""
        return (self.routing, self.weights, self.recompute.routes)

    @property
    def needs_entropy(self) -> bool:
        return any(loss.entropy_coef for loss in self.losses())


def apply_config(
    config: Mapping[str, Any], loss: LossConfig, routing: RoutingConfig, moe_layers: Sequence[int] = ()
) -> AppliedConfig:
    """The saved loss/routing with a normalised config's mitigations applied, each by its own declaration.

    `moe_layers`: the snapshot's model's MoE layers (absolute ids), what `current_routing_layers: first`
    resolves against (ConfigError when it is named and none are given)."""
    setup = ReplaySetup(loss=loss, routing=routing, moe_layers=tuple(moe_layers))
    for name, value in config.items():
        if not is_scoped(value):
            setup = _lookup(name).apply(setup, value)
    refuse_unread_dual_clip(config, setup.loss)
    rank_losses: dict[int, LossConfig] = {}
    for name, value in config.items():  # on top of the whole step's settings (none, in a hypothesis)
        if is_scoped(value):
            for rank in value["ranks"]:
                own = dataclasses.replace(setup, loss=rank_losses.get(int(rank), setup.loss))
                rank_losses[int(rank)] = _lookup(name).apply(own, value["value"]).loss
    resolved: dict[str, Any] = {}
    if config.get("current_routing_layers") == FIRST_MOE_LAYER:
        resolved["current_routing_layers"] = list(setup.routing.current_routing_layers)
    if setup.recompute.routes and setup.routing.replay == "off":
        raise ConfigError(
            "mitigation recompute: routes are not replayed (routing replay off): every rank already routes as the "
            "model does, so there is no recorded route to recompute"
        )
    return AppliedConfig(
        config_id=config_id(config),
        mitigations=dict(config),
        loss=setup.loss,
        routing=setup.routing,
        weights=setup.weights,
        samples=setup.samples,
        resolved=resolved,
        recompute=setup.recompute,
        rank_losses=dict(sorted(rank_losses.items())),
    )


def check_current_layers(cfg: AppliedConfig, moe_layers: Iterable[int]) -> None:
    """ConfigError when the config routes a layer on current scores that is no MoE layer of the model."""
    known = set(moe_layers)
    bad = sorted(set(cfg.routing.current_routing_layers) - known)
    if bad:
        raise ConfigError(f"{cfg.label}: current_routing_layers {bad} are not MoE layers (MoE layers: {sorted(known)})")
    bad = sorted(cfg.recompute.layers() - known)
    if bad:
        raise ConfigError(f"{cfg.label}: recompute names layers {bad}, not MoE layers (MoE layers: {sorted(known)})")


_ADVISED_RE = re.compile(r"`([a-z_]+):")  # a catalogue bullet names the mitigation it advises as `NAME: VALUE`


def advised_settings(symptoms: Iterable[str]) -> list[str]:
    """The production mitigations (`Mitigation.production`) the catalogue advises under any of `symptoms` (keys of
    SYMPTOMS): each bullet's own mitigation and those it names (`advantage_clip: 1` under another's advice), in
    declaration order: what a trainer can keep as its setting against those symptoms."""
    wanted = set(symptoms)
    unknown = sorted(wanted - set(SYMPTOMS))
    if unknown:
        raise ValueError(f"unknown symptom(s) {', '.join(unknown)} (known: {', '.join(SYMPTOMS)})")
    named = {
        name
        for m in MITIGATIONS.values()
        for a in m.advice
        if a.symptom in wanted
        for name in (m.name, *_ADVISED_RE.findall(a.text))
    }
    return [m.name for m in MITIGATIONS.values() if m.name in named and m.production]


def diagnostic_reasons(config: Mapping[str, Any]) -> list[str]:
    """`NAME: why` for each diagnostic-only mitigation a config uses (they are never written up as methods)."""
    found = [MITIGATIONS[name] for name in config if name in MITIGATIONS]
    return [f"{m.name}: {m.diagnostic}" for m in found if m.diagnostic]


def mitigation_args(config: Mapping[str, Any]) -> list[str]:
    """`NAME=VALUE` items that parse back to `config` (for command lines)."""
    items = []
    for name, value in config.items():
        if is_scoped(value):
            text = scope_text(value)
        elif isinstance(value, dict):
            text = ",".join(f"{k}:{v}" for k, v in value.items())
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            text = str(value).lower()
        else:
            text = str(value)
        items.append(f"{name}={text}")
    return items
