"""A replay's experiments as the snapshot allows them: applied and checked, and for a sweep, those refused one by one.

A replay's one config is refused whole (ConfigError or SnapshotError naming what is wrong). A sweep runs around a
refused config: a value its check refuses (`investigation.request.sweep_configs`, before anything runs), a lever this
snapshot cannot take (a rank or layer it does not have, a field its batches lack, an input no computation is defined
on) — the others run, and each refused one is reported in its place among the configs with the reason, as a failed
result the task logs under Failed attempts. A sweep whose every config is refused is refused whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.experiment.mitigation.mitigations import (
    AppliedConfig,
    apply_config,
    config_id,
    normal_form,
    parse_config,
)
from axrl_spike_replay.replay.reading.inputs import ReplayInputs, check_configs
from axrl_spike_replay.training.sample_masks import check_ranks


@dataclass(frozen=True)
class Refused:
    """A sweep's experiment refused: its place among the configs as given, the config (the saved setup under the
    config's name) and why."""

    place: int
    config: AppliedConfig
    why: str


@dataclass(frozen=True)
class Experiments:
    """The experiments that run (in the configs' order), those refused, and every config as asked (the command
    line names each, run or refused)."""

    applied: list[AppliedConfig]
    refused: list[Refused]
    asked: list[dict[str, Any]]


def experiments(
    inputs: ReplayInputs,
    configs: Sequence[Mapping[str, Any]],
    verb: str,
    refused_before: Sequence[tuple[int, Mapping[str, Any], str]] = (),
) -> Experiments:
    """The configs applied to the snapshot's setup and checked against it. A replay's config (and a sweep whose every
    config is refused) raises what refuses it; a sweep's refused configs are set aside with their reasons, beside
    `refused_before` (those the request refused: place among the configs as given, the config, why)."""
    moe_layers = inputs.model.moe_layer_ids  # what `current_routing_layers: first` resolves against
    base = apply_config({}, inputs.loss, inputs.routing)
    if verb != "sweep":
        applied = [apply_config(parse_config(c), inputs.loss, inputs.routing, moe_layers) for c in configs]
        _check(inputs, applied)
        return Experiments(applied, [], [dict(c.mitigations) for c in applied])
    before = sorted(int(r[0]) for r in refused_before)
    total = len(configs) + len(before)
    places = [p for p in range(total) if p not in set(before)]  # each accepted config's place among all
    refused = [Refused(int(p), _named(base, config), why) for p, config, why in refused_before]
    errors: list[Exception] = []
    applied: list[AppliedConfig] = []
    for place, config in zip(places, configs, strict=True):
        try:
            cfg = apply_config(parse_config(config), inputs.loss, inputs.routing, moe_layers)
            _check(inputs, [cfg])
        except (ConfigError, SnapshotError) as exc:
            errors.append(exc)
            refused.append(Refused(place, _named(base, config), str(exc)))
            continue
        applied.append(cfg)
    refused.sort(key=lambda r: r.place)
    if not applied:
        if len(refused) == 1 and errors:
            raise errors[0]
        raise ConfigError(
            "every config of the sweep is refused: " + "; ".join(f"config {r.place + 1}: {r.why}" for r in refused),
            "configs",
        )
    asked: dict[int, dict[str, Any]] = {r.place: dict(r.config.mitigations) for r in refused}
    asked |= {p: parse_config(c) for p, c in zip(places, configs, strict=True) if p not in asked}
    return Experiments(applied, refused, [asked[p] for p in range(total)])


def _check(inputs: ReplayInputs, applied: list[AppliedConfig]) -> None:
    """What refuses a config on this snapshot (check_configs, then the ranks its sample filter names)."""
    check_configs(inputs, applied)
    for cfg in applied:
        check_ranks(cfg.samples, inputs.world_size)


def _named(base: AppliedConfig, config: Mapping[str, Any]) -> AppliedConfig:
    """The saved setup under a refused config's name: what its failed result reports (the config as written)."""
    shown = normal_form(config)
    return replace(base, config_id=config_id(shown), mitigations=shown)
