"""The checkpoint-interval advice through MCP."""

from __future__ import annotations

from pathlib import Path

from server_helpers import call, error_text, ok


def test_checkpoint_interval_gives_the_young_daly_optimum(workspace: Path) -> None:
    advice = ok(call(workspace, "checkpoint_interval", {"checkpoint_cost_s": 20, "mtbf_steps": 2000, "step_time_s": 1}))
    assert advice["optimal_interval_steps"] == 283
    assert min(o["total_overhead"] for o in advice["options"]) == advice["optimal_overhead"]


def test_a_non_positive_cost_is_a_tool_error(workspace: Path) -> None:
    text = error_text(
        call(workspace, "checkpoint_interval", {"checkpoint_cost_s": 0, "mtbf_steps": 2000, "step_time_s": 1})
    )
    assert "checkpoint_cost_s" in text and "greater than 0" in text
