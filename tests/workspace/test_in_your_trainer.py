"""What to change in your trainer: a method file gives the proven change as each trainer's own setting, the trainer
that wrote the snapshot first, and the report lists each method as that trainer's setting, with its figures
explained and its baseline rows accounted for."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from record_helpers import JOB, SpikeRun, replay_result, save_result

from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.snapshot.layout import RUN_CONFIG
from axrl_spike_replay.workspace.method_files import front_matter
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.report import write_report
from axrl_spike_replay.workspace.task_record.task_log import record_replay

BASE = 37.42


def _attempt(workspace: Path, snapshot: Path, name: str, mitigations: dict, grad_norm: float) -> str:
    extra = {"mitigations": mitigations, "baseline_grad_norm": BASE, "change_vs_baseline": grad_norm / BASE - 1}
    result = replay_result(snapshot, grad_norm if mitigations else BASE, "cleared" if mitigations else "reproduced",
                           **(extra if mitigations else {}))  # fmt: skip
    exp_id = record_replay(workspace, JOB, result, save_result(workspace, name, result))
    assert exp_id is not None
    return exp_id


def _investigate(workspace: Path, snapshot: Path, configs: dict[str, dict]) -> None:
    open_task(workspace, JOB, str(snapshot), diagnosis="off")
    _attempt(workspace, snapshot, "base", {}, BASE)
    for slug, mitigations in configs.items():
        add_method(workspace, JOB, _attempt(workspace, snapshot, slug, mitigations, 2.0), slug, "it works")


def _section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_a_method_on_our_own_run_config_says_the_run_config_key_first(tmp_path: Path, spike_run: SpikeRun) -> None:
    _investigate(tmp_path, spike_run.snapshot, {"tis-2": {"mismatch_token_clip_max": 2.0}})

    method = tmp_path / "spike-mitigation-methods" / "tis-2.md"
    fields = front_matter.load(method)
    assert fields is not None and fields["trainer"] == "axrl"
    assert fields["trainer_settings"] == ["loss.mismatch_token_clip_max: 2.0"]
    rows = [line for line in _section(method.read_text(), "## In your trainer").splitlines() if line.startswith("| ")]
    assert rows[1].startswith("| **run_config.yaml (this tool's convention)** (this snapshot's) |")
    assert "`loss.mismatch_token_clip_max: 2.0`" in rows[1]
    assert rows[2].startswith("| verl 0.9.1 |") and (
        "`algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2`" in rows[2]
    )
    assert rows[3].startswith("| TRL 1.16 GRPOConfig |") and "vllm_importance_sampling_mode=token_truncate" in rows[3]
    assert rows[4].startswith("| Megatron-LM |") and "| none |" in rows[4]

    report = write_report(tmp_path, JOB)
    advice = _section(report.text, "## What to change in your trainer")
    assert "`loss.convention: axrl`" in advice and "run_config.yaml keys" in advice
    assert "1. **tis-2** (proven): `loss.mismatch_token_clip_max: 2.0`" in advice
    assert report.trainer is not None and report.trainer["methods"][0]["settings"] == [fields["trainer_settings"][0]]
    explained = _section(report.text, "## Methods added")
    assert (
        "**cosine to clean** is the cosine similarity" in explained and "**tokens touched** and **samples" in explained
    )


def test_a_method_on_a_verl_snapshot_gives_verls_overrides_and_says_what_has_none(
    tmp_path: Path, spike_run: SpikeRun
) -> None:
    outputs = tmp_path / "outputs" / spike_run.output_dir.name
    shutil.copytree(spike_run.output_dir, outputs)
    snapshot = outputs / spike_run.snapshot.relative_to(spike_run.output_dir)
    config = yaml.safe_load((snapshot / RUN_CONFIG).read_text())
    config["loss"]["convention"] = "verl"  # as the verl hook writes it
    (snapshot / RUN_CONFIG).write_text(yaml.safe_dump(config))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    _investigate(workspace, snapshot, {"dual-clip-3": {"dual_clip_c": 3.0}, "log-ratio-1": {"log_ratio_clip": 1.0}})

    method = (workspace / "spike-mitigation-methods" / "dual-clip-3.md").read_text()
    rows = [line for line in _section(method, "## In your trainer").splitlines() if line.startswith("| ")]
    assert rows[1].startswith(
        "| **verl 0.9.1** (this snapshot's) | dual_clip_c | `actor_rollout_ref.actor.clip_ratio_c=3`"
    )
    assert "records `loss.convention: verl`" in _section(method, "## In your trainer")

    advice = _section(write_report(workspace, JOB).text, "## What to change in your trainer")
    assert "by verl 0.9.1" in advice and "Hydra overrides of verl's trainer config" in advice
    assert "**dual-clip-3** (proven): `actor_rollout_ref.actor.clip_ratio_c=3`" in advice
    assert "**log-ratio-1** (proven): no setting; log_ratio_clip: no setting in verl 0.9.1" in advice


def test_a_sweep_reuses_the_logged_baseline_and_a_baseline_at_another_layout_is_its_own_row(
    tmp_path: Path, spike_run: SpikeRun
) -> None:
    """A `replay`, then a `sweep` (which replays its own baseline, to the same grad norm), then a reduced replay."""
    snapshot = spike_run.snapshot
    open_task(tmp_path, JOB, str(snapshot), diagnosis="off")
    runs = tmp_path / "tmp" / "spike-replay" / JOB
    first = replay_result(snapshot, BASE, "reproduced")
    path = save_result(tmp_path, "20260101-000000", first)
    (path.parent / "command.txt").write_text(f"axrl-spike-replay replay {snapshot}\n")
    assert record_replay(tmp_path, JOB, first, path) == "E1"
    (runs / "20260101-000100").mkdir()
    (runs / "20260101-000100" / "command.txt").write_text(f"axrl-spike-replay sweep {snapshot} --mitigation ...\n")
    base = replay_result(snapshot, BASE, "reproduced")
    assert record_replay(tmp_path, JOB, base, save_result(tmp_path, "20260101-000100/baseline", base)) == "E1"
    tis = replay_result(snapshot, 2.0, "cleared", mitigations={"mismatch_token_clip_max": 2.0}, baseline_grad_norm=BASE)
    assert (
        record_replay(tmp_path, JOB, tis, save_result(tmp_path, "20260101-000100/mismatch_token_clip_max=2", tis))
        == "E2"
    )
    reduced = replay_result(snapshot, BASE, "reproduced", fidelity="reduced", world_size_used=1)
    path = save_result(tmp_path, "20260101-000200", reduced)
    (path.parent / "command.txt").write_text(f"axrl-spike-replay replay {snapshot} --nproc 1\n")
    assert record_replay(tmp_path, JOB, reduced, path) == "E3"

    section = _section(write_report(tmp_path, JOB).text, "## Baseline replay")

    rows = [line for line in section.splitlines() if line.startswith("| E")]
    assert rows[0].startswith("| E1 | 5 | `replay` (baseline of E2) | local | full |")
    assert rows[1].startswith("| E3 | 5 | `replay` | local | reduced |")
    assert "Why 2 rows: every `replay` and every `sweep` replays the baseline itself" in section
    assert "reuses its row" in section
    assert "They agree to every digit: the replay is deterministic." in section


def test_a_method_on_a_trl_snapshot_gives_grpo_config_fields_first(tmp_path: Path, spike_run: SpikeRun) -> None:
    outputs = tmp_path / "outputs" / spike_run.output_dir.name
    shutil.copytree(spike_run.output_dir, outputs)
    snapshot = outputs / spike_run.snapshot.relative_to(spike_run.output_dir)
    config = yaml.safe_load((snapshot / RUN_CONFIG).read_text())
    config["loss"]["convention"] = "trl"  # as the TRL callback writes it
    (snapshot / RUN_CONFIG).write_text(yaml.safe_dump(config))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    _investigate(workspace, snapshot, {"gspo": {"importance_sampling_level": "sequence"}})

    method = (workspace / "spike-mitigation-methods" / "gspo.md").read_text()
    rows = [line for line in _section(method, "## In your trainer").splitlines() if line.startswith("| ")]
    assert rows[1].startswith("| **TRL 1.16 GRPOConfig** (this snapshot's) | importance_sampling_level |")
    assert "`importance_sampling_level=sequence`" in rows[1]
    assert "records `loss.convention: trl`" in _section(method, "## In your trainer")
    advice = _section(write_report(workspace, JOB).text, "## What to change in your trainer")
    assert "by TRL's GRPOTrainer" in advice and "fields of TRL's GRPOConfig" in advice
    assert "**gspo** (proven): `importance_sampling_level=sequence`" in advice
