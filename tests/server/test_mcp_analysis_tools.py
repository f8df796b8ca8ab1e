"""Reading signals through MCP: the logs copied and scanned with a plot, batch signals, parameter grads."""

from __future__ import annotations

import base64
from pathlib import Path

from server_helpers import ITERATION, JOB, RECORDED, SpikeOutputs, call, error_text, ok


def test_copy_and_scan_logs_copies_into_the_workspace_finds_the_spike_and_plots_it(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    result = call(workspace, "copy_and_scan_logs", {"logs": [str(spike_outputs.output_dir)], "warmup": 3})
    scan = ok(result)
    dest = workspace / "tmp" / "spike-replay" / JOB / "logs"
    assert Path(scan["dest"]) == dest
    assert all(Path(c).is_relative_to(dest) and Path(c).is_file() for c in scan["copied"])
    assert len(scan["series_points"]) == 11
    assert [(s["iteration"], s["grad_norm"]) for s in scan["spikes"]] == [(ITERATION, RECORDED)]
    [image] = [c for c in result.content if c.type == "image"]
    assert image.mime_type == "image/png"
    assert base64.b64decode(image.data).startswith(b"\x89PNG\r\n\x1a\n")


def test_copy_and_scan_logs_of_a_missing_file_is_a_tool_error(workspace: Path) -> None:
    text = error_text(call(workspace, "copy_and_scan_logs", {"logs": ["nowhere/train.log"]}))
    assert "nowhere/train.log" in text and "not found" in text


def test_analyze_batch_reports_signals_and_outliers(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    doc = ok(call(workspace, "analyze_batch", {"snapshot": str(spike_outputs.snapshot), "top": 3}))
    assert doc["iteration"] == ITERATION and doc["ranks"] == [0, 1]
    assert doc["sign_balance"] is not None and doc["outliers"]


def test_top_param_grads_merges_ranks(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    doc = ok(call(workspace, "top_param_grads", {"snapshot": str(spike_outputs.snapshot), "top": 5}))
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert doc["merged"][0]["name"] == "embed.weight"
    text = error_text(call(workspace, "top_param_grads", {"snapshot": str(spike_outputs.snapshot), "top": 0}))
    assert "top" in text
