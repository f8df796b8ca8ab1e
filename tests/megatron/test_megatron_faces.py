"""Route 2 from the faces: `replay --backend megatron` through the CLI (its main; a mitigation's refusal through
the console script, a real process) and the `replay` tool through a real MCP stdio session replay a captured
Megatron snapshot with megatron-core's own GPTModel, judge it as the torch backend is judged and leave the same
record (command.txt, replay_result.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from megatron_helpers import CliRun

pytestmark = pytest.mark.slow


def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "axrl-spike-replay"
    return [str(script)] if script.exists() else [sys.executable, "-m", "axrl_spike_replay"]


def _record(workspace: Path) -> tuple[str, dict[str, Any]]:
    """(command.txt, replay_result.json) of the one run recorded in the workspace."""
    (result,) = workspace.glob("tmp/spike-replay/*/*/replay_result.json")
    return (result.parent / "command.txt").read_text(), json.loads(result.read_text())


def test_the_cli_replays_a_megatron_snapshot_with_megatron_core(megatron_cli_route2: CliRun) -> None:
    workspace, argv, doc = megatron_cli_route2.workspace, megatron_cli_route2.argv, megatron_cli_route2.doc
    assert (doc["backend"], doc["verdict"], doc["fidelity"], doc["world_size_used"]) == (
        "megatron",
        "reproduced",
        "full",
        2,
    )
    assert doc["rel_diff"] < 1e-6
    command, written = _record(workspace)
    assert "--backend megatron" in command
    assert written["backend"] == "megatron" and written["grad_norm"] == doc["grad_norm"]

    refused = subprocess.run(
        [*argv, "--mitigation", "advantage_clip=0.5", "--workspace", str(workspace)], capture_output=True, text=True
    )
    assert refused.returncode != 0
    assert "mitigations run on the built-in --backend torch" in refused.stderr
    assert len(list(workspace.glob("tmp/spike-replay/*/*/replay_result.json"))) == 1  # the refusal wrote nothing


def test_the_mcp_replay_tool_replays_a_megatron_snapshot_with_megatron_core(
    megatron_capture: Path, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    cmd = _console_script()
    params = StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])

    async def session() -> tuple[dict[str, Any], str]:
        async with Client(params) as client:
            done = await client.call_tool("replay", {"snapshot": str(megatron_capture), "backend": "megatron"})
            assert not done.is_error, done.content[0].text  # type: ignore[union-attr]
            refused = await client.call_tool(
                "sweep",
                {"snapshot": str(megatron_capture), "backend": "megatron", "configs": [{"advantage_clip": 0.5}]},
            )
            assert refused.is_error
            return done.structured_content or {}, refused.content[0].text  # type: ignore[union-attr]

    result, refusal = anyio.run(session)
    assert (result["backend"], result["verdict"]) == ("megatron", "reproduced")
    assert result["rel_diff"] < 1e-6
    assert "a sweep runs on the built-in `backend` torch" in refusal
    command, written = _record(workspace)
    assert "--backend megatron" in command and written["verdict"] == "reproduced"
