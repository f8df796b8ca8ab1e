"""A mitigation config as changes to each trainer's own configuration, from the declarations
(`experiment.mitigation.mitigations.MITIGATIONS[name].settings`, see `experiment.mitigation.trainer_settings`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS
from axrl_spike_replay.experiment.mitigation.rank_scope import is_scoped, scope_text
from axrl_spike_replay.experiment.mitigation.trainer_settings import TRAINERS, flow

SCOPED_NOTE = "scoped to ranks: a hypothesis about what those ranks computed, not a setting of the trainer"


@dataclass(frozen=True)
class TrainerChange:
    """One mitigation of a config in one trainer: its setting (None: the trainer has none) and a note."""

    trainer: str  # a TRAINERS key
    mitigation: str
    value: str  # the value the config gives, as YAML on one line
    setting: str | None
    note: str = ""


def trainer_changes(
    config: Mapping[str, Any], resolved: Mapping[str, Any] | None = None, trainers: tuple[str, ...] = tuple(TRAINERS)
) -> list[TrainerChange]:
    """Per trainer (in `trainers` order), per mitigation of the normal-form `config`: the setting that makes the same
    change in training. `resolved` holds values the replay resolved against the model (`current_routing_layers:
    first` -> [1]); a trainer takes the resolved value. A diagnostic-only mitigation gets no setting, with why."""
    out: list[TrainerChange] = []
    for trainer in trainers:
        for name, value in config.items():
            mitigation = MITIGATIONS.get(name)
            used = (resolved or {}).get(name, value)
            if mitigation is None:
                out.append(TrainerChange(trainer, name, flow(value), None, "not a mitigation of this tool"))
                continue
            if is_scoped(value):  # a hypothesis, never a fix: a trainer sets its loss for every rank
                out.append(TrainerChange(trainer, name, scope_text(value), None, SCOPED_NOTE))
                continue
            if mitigation.diagnostic:
                note = f"diagnostic only, no setting: {mitigation.diagnostic}"
                out.append(TrainerChange(trainer, name, flow(value), None, note))
                continue
            own = [s for s in mitigation.settings if s.trainer == trainer]
            if not own:
                out.append(TrainerChange(trainer, name, flow(value), None, "no setting declared for this trainer"))
            for setting in own:
                text = setting.setting(used)
                note = setting.note if text is not None or setting.note else f"no setting for the value {flow(used)}"
                out.append(TrainerChange(trainer, name, flow(value), text, note))
    return out
