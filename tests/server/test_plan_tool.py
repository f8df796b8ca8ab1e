"""`plan_replay` over a real MCP client session: the plan of a config-only snapshot against a described node, and a
bad argument named."""

from __future__ import annotations

from pathlib import Path

from server_helpers import call, error_text, ok

from axrl_spike_replay.testing.config_only_snapshot import QWEN3_30B_A3B, write_config_only_snapshot


def test_plan_replay_says_what_a_config_only_snapshot_needs(tmp_path: Path) -> None:
    snap = write_config_only_snapshot(tmp_path / "q", "qwen3_moe", QWEN3_30B_A3B, world_size=16, batch=1, seq=256)
    doc = ok(call(tmp_path, "plan_replay", {"snapshot": str(snap), "gpus": 8, "gpu_memory_gib": 141}))
    assert doc["parameters"] > 30e9 and doc["world_size"] == 16 and doc["fits"] is True
    assert doc["chosen"]["sharded"] is True and doc["chosen"]["processes_per_device"] == 2
    assert "30.5B parameters" in doc["summary"] and "layout: 16 processes" in doc["summary"]
    said = error_text(call(tmp_path, "plan_replay", {"snapshot": str(snap), "gpus": 8}))
    assert "give `gpus` and `gpu_memory_gib` together" in said


def test_a_described_node_out_of_bounds_is_named(tmp_path: Path) -> None:
    """Once `gpu_memory_gib` 1e300 overflowed to a traceback's OverflowError; each bound is in the schema and named."""
    snap = write_config_only_snapshot(tmp_path / "q", "qwen3_moe", QWEN3_30B_A3B, world_size=16, batch=1, seq=256)
    for gpus, memory, says in ((1, 1e300, "gpu_memory_gib"), (10**12, 80, "gpus"), (1, 0, "gpu_memory_gib")):
        arguments = {"snapshot": str(snap), "gpus": gpus, "gpu_memory_gib": memory}
        said = error_text(call(tmp_path, "plan_replay", arguments))
        assert says in said and "Overflow" not in said and len(said) < 1000, said
        assert ("4096" if says == "gpus" else "65536" if memory else "greater than 0") in said, said
