"""diagnose_spike through MCP: the same diagnosis as the library, as structured content."""

from __future__ import annotations

from pathlib import Path

from server_helpers import call, ok


def test_diagnose_spike_ranks_the_mismatch_first_with_ready_mitigations(captured_run, workspace: Path) -> None:
    doc = ok(call(workspace, "diagnose_spike", {"snapshot": str(captured_run.snapshot_dirs[0]), "model": "never"}))
    assert doc["causes"][0]["family"] == "engine_mismatch"
    assert doc["next_steps"][0]["mitigation"] == "mismatch_token_clip_max=2"
    assert doc["consistency"]["self_consistent"] is True and doc["consistency"]["agrees_with_log"] is True
