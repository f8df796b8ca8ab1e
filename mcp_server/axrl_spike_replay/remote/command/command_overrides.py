"""Our mitigation names mapped onto the trainer's own overrides, for the `command` backend.

`spike-replay.yaml`'s `command_backend.mitigations` maps a mitigation name to an override template,
e.g. `mismatch_token_clip_max: "--actor.mismatch_token_clip_max={value}"`. A config's overrides fill
`{overrides}` in the command. The template is split into words like a shell would, `{value}` is put
into each word as text, and every resulting word is shell-quoted: a value can never become shell
syntax, whatever it holds. Values are validated by the mitigation parser first (`experiment.mitigation.mitigations`).
"""

from __future__ import annotations

import math
import shlex
import string
from collections.abc import Mapping, Sequence
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import FIRST_MOE_LAYER, MITIGATIONS
from axrl_spike_replay.experiment.mitigation.rank_scope import is_scoped

VALUE = "value"


def check_override_template(name: str, template: str, source: str, where: str) -> None:
    """ConfigError unless `name` is a mitigation and `template` splits into words using only `{value}`."""
    if name not in MITIGATIONS:
        raise ConfigError(f"{source}: {where}: {shown(name)} is not a mitigation; known: {', '.join(MITIGATIONS)}")
    words = _words(template, source, where)
    used = False
    for word in words:
        try:
            fields = [field for _lit, field, _spec, _conv in string.Formatter().parse(word) if field is not None]
        except ValueError as exc:
            raise ConfigError(
                f"{source}: {where}: bad placeholder syntax ({exc}); write {{{{ and }}}} for braces"
            ) from None
        for field in fields:
            if field != VALUE:
                raise ConfigError(f"{source}: {where}: unknown placeholder {{{field}}}; use {{value}}")
            used = True
    if not used:
        raise ConfigError(f"{source}: {where}: put {{value}} where the value goes, e.g. --trainer.knob={{value}}")


def _words(template: str, source: str, where: str) -> list[str]:
    try:
        words = shlex.split(template)
    except ValueError as exc:  # an unbalanced quote
        raise ConfigError(f"{source}: {where}: cannot split it into words ({exc})") from None
    if not words:
        raise ConfigError(f"{source}: {where} must be a non-empty override such as --trainer.knob={{value}}")
    return words


def value_text(value: Any) -> str:
    """A normal-form value as the override gets it: 2 (a whole float), 0.5, true/false, 0,1 (a list),
    level:token,low:0.5 (a mapping), else the text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if math.isfinite(value) and value.is_integer() else repr(value)
    if isinstance(value, Mapping):
        return ",".join(f"{k}:{value_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ",".join(value_text(v) for v in value)
    return str(value)


def unmapped(mapping: Mapping[str, str], configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The mitigation names the configs use that `mapping` has no override for (in first-use order)."""
    missing: list[str] = []
    for config in configs:
        missing += [name for name in config if name not in mapping and name not in missing]
    return missing


def check_mapped(mapping: Mapping[str, str], configs: Sequence[Mapping[str, Any]], source: str) -> None:
    """ConfigError (parameter `mitigations`) naming each mitigation without an override and the mapped ones."""
    missing = unmapped(mapping, configs)
    if not missing:
        return
    mapped = ", ".join(sorted(mapping)) or "none"
    raise ConfigError(
        f"`mitigations` {', '.join(missing)}: no override for {'it' if len(missing) == 1 else 'them'} in "
        f"{source} command_backend.mitigations (mapped: {mapped}); map it to the trainer's own option "
        '(e.g. NAME: "--trainer.knob={value}"), or express the change as `patch` FILE.diff',
        "mitigations",
    )


def check_concrete(configs: Sequence[Mapping[str, Any]]) -> None:
    """ConfigError (parameter `mitigations`) when a config names a layer the trainer's command cannot resolve: only
    the torch engine builds the model, so `current_routing_layers: first` needs the layer ids here; or a setting
    scoped to ranks, which no trainer's override can express."""
    for config in configs:
        scoped = sorted(name for name, value in config.items() if is_scoped(value))
        if scoped:
            raise ConfigError(
                f"`mitigations` {', '.join(scoped)} scoped to ranks: a trainer's command sets its loss for every "
                "rank, so a hypothesis about some ranks' loss replays in the torch engine only (`backend` torch)",
                "mitigations",
            )
        if config.get("current_routing_layers") == FIRST_MOE_LAYER:
            raise ConfigError(
                f"`mitigations` current_routing_layers={FIRST_MOE_LAYER}: the command backend does not build the "
                "model, so it cannot tell which layer is its first MoE layer; name the layer ids (e.g. 1)",
                "mitigations",
            )


def render_overrides(mapping: Mapping[str, str], config: Mapping[str, Any]) -> str:
    """The shell words for a normalised config, in its (sorted) order, each word quoted; '' for the baseline."""
    words: list[str] = []
    for name, value in config.items():
        text = value_text(value)
        for word in shlex.split(mapping[name]):
            pieces = []
            for literal, field, _spec, _conv in string.Formatter().parse(word):
                pieces.append(literal)
                if field is not None:
                    pieces.append(text)
            words.append(shlex.quote("".join(pieces)))
    return " ".join(words)
