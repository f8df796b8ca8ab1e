"""A loss setting scoped to saved ranks: `NAME=VALUE@RANKS` (`aux_loss_coef=10.24@1`, `loss_agg_mode=seq-mean-token-
mean@0,2`; in YAML also `{value: 10.24, ranks: [1]}`), for the mitigations the table declares `per_rank`.

A scoped setting is a hypothesis about what those ranks computed (a config override that reached one node, a
rank-dependent branch in the trainer), not a fix: a trainer sets its loss for every rank. A config made of scoped
settings is therefore judged against the recording, as a baseline is ("reproduced under `aux_loss_coef=10.24@1`"),
never against the baseline; a config cannot mix one with a mitigation (`check_hypothesis`).

The normal form of a scoped value is `{"ranks": [sorted distinct ids], "value": <the mitigation's own normal form>}`;
its text is `VALUE@R1,R2` (`scope_text`). Torch-free, as the mitigation registry is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

SEPARATOR = "@"
SCOPE_KEYS = frozenset({"ranks", "value"})
OPTIONAL = "optional"  # the setting applies to every rank, or to the ranks named after `@`
REQUIRED = "required"  # the setting only has a meaning on some ranks (a plain scale of one rank's loss)
PER_RANK = ("", OPTIONAL, REQUIRED)


def is_scoped(value: Any) -> bool:
    """Whether a (normal-form or raw mapping) value is scoped to ranks: exactly `value` and `ranks`."""
    return isinstance(value, Mapping) and set(value) == SCOPE_KEYS


def split_scope(raw: Any) -> tuple[Any, Any] | None:
    """(the value, the ranks) of a raw scoped value: `VALUE@RANKS` text or a {value, ranks} mapping; None when the
    value names no ranks."""
    if is_scoped(raw):
        return raw["value"], raw["ranks"]
    if isinstance(raw, str) and SEPARATOR in raw:
        value, _, ranks = raw.rpartition(SEPARATOR)
        return value.strip(), ranks.strip()
    return None


def check_hypothesis(config: Mapping[str, Any], source: str) -> None:
    """ConfigError when a config mixes settings scoped to ranks with unscoped ones: the first are a hypothesis about
    what the trainer computed (judged against the recording), the others mitigations (judged against the baseline),
    and one replay cannot be judged both ways."""
    scoped = sorted(name for name, value in config.items() if is_scoped(value))
    plain = sorted(name for name, value in config.items() if not is_scoped(value))
    if scoped and plain:
        raise ConfigError(
            f"{source}: {', '.join(scoped)} scoped to ranks (a hypothesis about what those ranks computed, judged "
            f"against the recording) cannot be combined with {', '.join(plain)} (a mitigation, judged against the "
            "baseline) in one replay; replay them separately",
            "mitigations",
        )


def is_hypothesis(config: Mapping[str, Any] | None) -> bool:
    """Whether a normal-form config is a hypothesis: it sets something, and only settings scoped to ranks."""
    values = list((config or {}).values())
    return bool(values) and all(is_scoped(v) for v in values)


def value_text(value: Any) -> str:
    """A normal-form value as it is written after `NAME=` (whole floats as integers, booleans in lower case)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(value_text(v) for v in value)
    return str(value)


def scope_text(value: Mapping[str, Any]) -> str:
    """`VALUE@R1,R2`: how a scoped normal-form value is written (and parses back)."""
    return f"{value_text(value['value'])}{SEPARATOR}{','.join(str(r) for r in value['ranks'])}"


def hypothesis_text(config: Mapping[str, Any]) -> str:
    """A hypothesis in the words a result, a task row and the report use: `aux_loss_coef=10.24@1` (several settings
    joined by spaces, as `--mitigation` items)."""
    return " ".join(f"{name}={scope_text(value)}" for name, value in config.items() if is_scoped(value))


def finding(verdict: str, config: Mapping[str, Any]) -> str:
    """`reproduced under `aux_loss_coef=10.24@1`` (or `not reproduced under ...`, `failed under ...`)."""
    words = {"reproduced": "reproduced", "not_reproduced": "not reproduced"}.get(str(verdict), str(verdict))
    return f"{words} under `{hypothesis_text(config)}`"


def scope_error(name: str, raw: Any) -> ConfigError:
    """The error for a rank scope on a mitigation that takes none."""
    return ConfigError(
        f"mitigation {name}: {shown(raw)} names ranks after {SEPARATOR!r}, but {name} cannot be scoped to ranks "
        "(only loss settings can: docs/mitigations.md lists them)",
        "mitigations",
    )
