"""An agent passes values it got from elsewhere: an alias bomb in a mitigation, a directory whose name
climbs out of tmp/, a workspace whose tmp/ is a symlink. Each is a short tool error and nothing is written."""

from __future__ import annotations

import shutil
from pathlib import Path

from server_helpers import SpikeOutputs, call, error_text, ok


def _alias_bomb(levels: int = 6) -> str:
    parts = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "{" + ", ".join(parts) + "}"


def test_an_alias_bomb_in_a_mitigation_value_is_a_short_tool_error(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    arguments = {"snapshot": str(spike_outputs.snapshot), "mitigations": {"ratio_outlier_mask": _alias_bomb()}}
    text = error_text(call(workspace, "replay", arguments))
    assert "ratio_outlier_mask" in text and "alias" in text and len(text) < 2000
    sweep = {"snapshot": str(spike_outputs.snapshot), "configs": [{"ratio_outlier_mask": "{level: token"}]}
    text = error_text(call(workspace, "sweep", sweep))
    assert "ratio_outlier_mask: not valid YAML" in text and len(text) < 2000
    assert not (workspace / "tmp").exists()


def test_a_job_name_derived_from_a_climbing_directory_name_is_refused(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    climbing = spike_outputs.root / "r~..__actor"
    shutil.copytree(spike_outputs.output_dir, climbing)
    text = error_text(call(workspace, "copy_and_scan_logs", {"logs": [str(climbing)], "plot": False}))
    assert "job name derived from the log paths" in text and "'..'" in text
    assert not (workspace / "tmp").exists()


def test_a_job_name_with_a_trailing_newline_is_refused(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    arguments = {"logs": [str(spike_outputs.output_dir)], "job": "fx-job\n", "plot": False}
    text = error_text(call(workspace, "copy_and_scan_logs", arguments))
    assert "job name 'fx-job\\n' is not a plain file name" in text
    assert not (workspace / "tmp").exists()


def test_logs_are_not_copied_through_a_tmp_symlinked_out_of_the_workspace(
    spike_outputs: SpikeOutputs, workspace: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (workspace / "tmp").symlink_to(elsewhere)
    text = error_text(call(workspace, "copy_and_scan_logs", {"logs": [str(spike_outputs.output_dir)], "plot": False}))
    assert "leads outside" in text and str(workspace) in text
    assert list(elsewhere.iterdir()) == []


def test_a_log_symlinked_out_of_the_output_dir_is_reported_as_skipped(
    spike_outputs: SpikeOutputs, workspace: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.log"
    secret.write_text("step=1 grad_norm=1.0\n")
    (spike_outputs.output_dir / "notes.log").symlink_to(secret)
    doc = ok(call(workspace, "copy_and_scan_logs", {"logs": [str(spike_outputs.output_dir)], "plot": False}))
    assert [Path(s["path"]).name for s in doc["skipped"]] == ["notes.log"]
    assert [Path(c).name for c in doc["copied"]] == ["train.log"]


def test_a_symlink_loop_given_as_a_log_is_a_tool_error(workspace: Path) -> None:
    (workspace / "loop.log").symlink_to(workspace / "loop.log")
    text = error_text(call(workspace, "copy_and_scan_logs", {"logs": ["loop.log"], "plot": False}))
    assert "loop.log: log file or directory not found (a symlink that is broken or a loop)" in text
