"""The report's "What to change in your trainer": each method written up, as the setting of the trainer that wrote
the snapshot (from the method files, which hold every trainer's settings)."""

from __future__ import annotations

from typing import Any

from axrl_spike_replay.experiment.mitigation.mitigations import normal_form
from axrl_spike_replay.experiment.mitigation.trainer_changes import trainer_changes
from axrl_spike_replay.experiment.mitigation.trainer_settings import NO_MEGATRON_FLAG, TRAINERS, snapshot_trainer


def trainer_advice(methods: list[dict[str, Any]], snapshot: str | None) -> dict[str, Any]:
    """{trainer, label, known, methods: [{slug, status, settings, notes, path}], no_megatron_flag: [slug]} for the
    ranked `methods` (front matter rows). The trainer is the one the method files recorded, else the task
    snapshot's, else this tool's own run config (`known` False: the snapshot's run config could not be read)."""
    recorded = [m.get("trainer") for m in methods if m.get("trainer") in TRAINERS]
    trainer = recorded[0] if recorded else snapshot_trainer(snapshot)
    known = trainer is not None
    trainer = trainer or "axrl"
    rows = []
    no_megatron_flag = []
    for method in methods:
        config = method.get("mitigations") if isinstance(method.get("mitigations"), dict) else {}
        megatron = trainer_changes(normal_form(config), trainers=("megatron",)) if config else []
        if megatron and all(c.setting is None and c.note == NO_MEGATRON_FLAG.note for c in megatron):
            no_megatron_flag.append(method.get("slug"))
        changes = trainer_changes(normal_form(config), trainers=(trainer,)) if config else []
        settings = method.get("trainer_settings")
        if not isinstance(settings, list) or method.get("trainer") != trainer:  # written before the field existed
            settings = [c.setting for c in changes if c.setting]
        notes = [f"{c.mitigation}: {c.note}" for c in changes if not c.setting]
        rows.append(
            {
                "slug": method.get("slug"),
                "status": method.get("status"),
                "settings": [str(s) for s in settings],
                "notes": notes,
                "patch": bool(method.get("patch_sha256")),
                "path": method.get("path"),
            }
        )
    return {
        "trainer": trainer,
        "label": TRAINERS[trainer],
        "known": known,
        "methods": rows,
        # the methods Megatron-LM has no flag for (its RL loss lives in the trainer on top): said once, in the report
        "no_megatron_flag": no_megatron_flag,
    }
