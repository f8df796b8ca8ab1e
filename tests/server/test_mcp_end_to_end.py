"""The whole procedure on the golden fixture, as an agent runs it: MCP calls over real stdio only, then the files
it leaves are checked — resolve, preserve, read, replay, sweep, write up, report, release."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters
from server_helpers import server_command

JOB = "fixture-moe"
ITERATION = 20


async def _call(client: Client, tool: str, arguments: dict[str, Any], **kw: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments, **kw)
    assert not result.is_error, f"{tool}: {result.content[0].text}"
    return result.structured_content


def test_the_full_procedure_through_mcp_leaves_the_record(fixture_outputs: Path, tmp_path: Path) -> None:
    roots = tmp_path / "outputs"
    roots.mkdir()
    shutil.copytree(fixture_outputs / f"fx~{JOB}__actor", roots / f"fx~{JOB}__actor")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    cmd = server_command()
    params = StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])
    progress: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def procedure() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with Client(params) as client:
            found = await _call(client, "resolve_job", {"job": JOB, "roots": [str(roots)]})
            out = found["roles"][0]["output_dir"]
            listing = await _call(client, "list_snapshots", {"output_dir": out})
            assert ITERATION in [s["iteration"] for s in listing["snapshots"]]
            kept = await _call(client, "preserve_snapshots", {"output_dir": out, "iteration": ITERATION})
            snapshot = kept["preserved"][0]["path"]
            await _call(client, "task_open", {"job": JOB, "snapshot": snapshot})

            seen["inspect"] = await _call(client, "inspect_snapshot", {"snapshot": snapshot})
            seen["analyze"] = await _call(client, "analyze_batch", {"snapshot": snapshot, "top": 3})
            seen["grads"] = await _call(client, "top_param_grads", {"snapshot": snapshot, "top": 3})
            seen["logs"] = await _call(client, "copy_and_scan_logs", {"logs": [out]})
            await _call(
                client,
                "task_note",
                {"job": JOB, "section": "observations", "text": "ratio outliers on a few tokens of rank 0 and 1"},
            )

            seen["baseline"] = await _call(client, "replay", {"snapshot": snapshot}, progress_callback=on_progress)
            configs = [{"mismatch_token_clip_max": 2}, {"advantage_clip": 0.5}]
            seen["sweep"] = await _call(client, "sweep", {"snapshot": snapshot, "configs": configs})
            task = await _call(client, "task_show", {"job": JOB})
            cleared = [e for e in task["experiments"] if e["verdict"] == "cleared"]
            seen["method"] = await _call(
                client,
                "method_add",
                {
                    "job": JOB,
                    "attempt": cleared[0]["id"],
                    "name": "tis-clip-2",
                    "rationale": "truncated importance sampling caps the rollout/train ratio outliers",
                },
            )
            seen["report"] = await _call(client, "write_report", {"job": JOB})
            seen["released"] = await _call(client, "release_preserved", {"output_dir": out, "iteration": ITERATION})
            seen["task"] = await _call(client, "task_show", {"job": JOB})
            seen.update(output_dir=out, snapshot=snapshot)
        return seen

    seen = anyio.run(procedure)

    # What the agent read.
    assert seen["inspect"]["world_size"] == 2 and seen["inspect"]["problems"] == []
    assert seen["analyze"]["outliers"] and seen["grads"]["merged"]
    assert ITERATION in [s["iteration"] for s in seen["logs"]["spikes"]]
    baseline = seen["baseline"]
    assert (baseline["verdict"], baseline["fidelity"]) == ("reproduced", "full")
    assert baseline["rel_diff"] <= 1e-6
    assert any("replaying" in m for m in progress)
    verdicts = {r["config_id"]: r["verdict"] for r in seen["sweep"]["results"]}
    assert verdicts["mismatch_token_clip_max=2"] == "cleared"

    # The files it left: task file, outputs, method, report; the preserved copy is gone, the source untouched.
    task_md = workspace / "agent-task" / "spike-replay" / f"{JOB}.md"
    text = task_md.read_text()
    assert "ratio outliers on a few tokens" in text
    ids = [e["id"] for e in seen["task"]["experiments"]]
    assert len(ids) == 1 + 2  # the baseline replay, then the sweep's two configs (its baseline reuses E1)
    assert {e.get("baseline") for e in seen["task"]["experiments"][1:]} == {ids[0]}
    assert all(i in text for i in ids)
    for row in seen["task"]["experiments"]:
        result = json.loads(Path(row["result_path"]).read_text())
        assert Path(row["result_path"]).is_relative_to(workspace / "tmp" / "spike-replay" / JOB)
        assert result["verdict"] == row["verdict"]
    assert (Path(baseline["output_dir"]) / "command.txt").is_file()
    assert (workspace / "tmp" / "spike-replay" / JOB / "logs").is_dir()

    method = workspace / "spike-mitigation-methods" / "tis-clip-2.md"
    assert seen["method"]["status"] == "proven" and method.is_file()
    assert "mismatch_token_clip_max" in method.read_text()
    assert "tis-clip-2" in (workspace / "spike-mitigation-methods" / "README.md").read_text()

    report = workspace / "tmp" / "spike-replay" / JOB / "report.md"
    assert Path(seen["report"]["path"]) == report and "tis-clip-2" in report.read_text()

    assert [r["path"] for r in seen["released"]["released"]] == [seen["snapshot"]]
    assert not Path(seen["snapshot"]).exists()
    assert (Path(seen["output_dir"]) / "checkpoints" / "spike_snapshots" / f"iter_{ITERATION:07d}").is_dir()
