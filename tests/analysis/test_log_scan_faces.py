"""Both faces scan logs the same way: the run's own detector settings, and a bounded JSON series."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
from mcp import Client

from axrl_spike_replay.server import create_server


def _run_with_settings(root: Path) -> Path:
    """An output dir whose run tripped on a 3x norm (threshold 2.5, short warm-up): the defaults
    (window 20, threshold 5, warm-up 10) would see no spike there."""
    out = root / "run1~job-a__actor"
    config = out / "checkpoints" / "spike_snapshots" / "iter_0000006" / "run_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("detector:\n  kind: median_ratio\n  window: 4\n  threshold: 2.5\n  warmup: 2\n")
    (out / "logs").mkdir()
    norms = [1.0, 1.1, 1.0, 1.05, 1.0, 3.0, 1.0, 1.1, 1.0, 1.0, 1.05, 1.0]
    (out / "logs" / "train.log").write_text(
        "".join(f"step={i} grad_norm={n} loss=0.5\n" for i, n in enumerate(norms, start=1))
    )
    return out


def _mcp_scan(workspace: Path, arguments: dict) -> dict:
    async def main() -> dict:
        async with Client(create_server(workspace)) as client:
            result = await client.call_tool("copy_and_scan_logs", arguments)
            assert not result.is_error, getattr(result.content[0], "text", result.content[0])
            return result.structured_content

    return anyio.run(main)


def test_mcp_and_cli_use_the_runs_detector_settings(tmp_path: Path, cli) -> None:
    """Before: MCP passed window=20, threshold=5, warmup=10, missed this spike, and still said its settings
    came from run_config.yaml."""
    out = _run_with_settings(tmp_path / "outputs")
    workspace = tmp_path / "ws"
    workspace.mkdir()

    by_mcp = _mcp_scan(workspace, {"logs": [str(out)], "plot": False})
    by_cli = cli("logs", out, "--dest", tmp_path / "copies", "--json").json()

    for doc in (by_mcp, by_cli):
        assert [s["iteration"] for s in doc["spikes"]] == [6]
        assert doc["detector"]["threshold"] == 2.5 and doc["detector"]["window"] == 4
        assert doc["detector"]["source"].endswith("run_config.yaml")
    # a setting given still wins over the run's
    assert _mcp_scan(workspace, {"logs": [str(out)], "plot": False, "threshold": 5.0})["spikes"] == []


def test_json_of_a_long_series_is_compact_and_sampled_with_spikes_exact(tmp_path: Path, cli) -> None:
    log = tmp_path / "long.log"
    norms = {i: (40.0 if i in (3000, 41000) else 1.0 + (i % 5) / 100) for i in range(1, 50_001)}
    log.write_text("".join(f"step={i} grad_norm={n} loss=0.5\n" for i, n in norms.items()))

    run = cli("logs", log, "--dest", tmp_path / "copies", "--json")

    assert run.code == 0, run.err
    assert "\n" not in run.out.rstrip("\n") and ", " not in run.out  # one compact line
    doc = run.json()
    assert doc["series_total"] == 50_000 and doc["series_sampled"] is True
    assert len(doc["series_points"]) <= 2200
    assert [s["iteration"] for s in doc["spikes"]] == [3000, 41000]
    kept = {p["iteration"]: p["grad_norm"] for p in doc["series_points"]}
    for spike in (3000, 41000):  # each spike with its 20 neighbours on each side, exact
        assert all(kept[i] == norms[i] for i in range(spike - 20, spike + 21))
    assert all(kept[i] == norms[i] for i in kept) and 1 in kept and 50_000 in kept

    full = cli("logs", log, "--dest", tmp_path / "copies", "--json", "--full-series").json()
    assert [p["iteration"] for p in full["series_points"]] == list(range(1, 50_001))
    assert full["series_sampled"] is False
    human = cli("logs", log, "--dest", tmp_path / "copies")
    assert "50000 lines, 50000 iterations" in human.out


def test_mcp_returns_a_sampled_series_unless_asked_for_all(tmp_path: Path) -> None:
    log = tmp_path / "long.log"
    log.write_text("".join(f"step={i} grad_norm=1.0 loss=0.5\n" for i in range(1, 5001)))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    sampled = _mcp_scan(workspace, {"logs": [str(log)], "plot": False, "job": "j"})
    assert sampled["series_total"] == 5000 and len(sampled["series_points"]) <= 2200
    full = _mcp_scan(workspace, {"logs": [str(log)], "plot": False, "job": "j", "full_series": True})
    assert len(full["series_points"]) == 5000 and json.dumps(full)
