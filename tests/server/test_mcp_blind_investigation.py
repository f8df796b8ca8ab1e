"""The skill's blind investigation of the demo's spike, driven over MCP from the lean tool list alone: from a fresh
workspace it reaches the report the CLI reaches with the same steps on the same snapshot. The agent's side knows
only what tools/list and the results say: which snapshot is worst, what the diagnosis suggests, which attempt
cleared."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters
from server_helpers import server_command

JOB = "demo-moe-grpo"


async def _call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, f"{tool}: {result.content[0].text}"
    assert result.structured_content is not None
    return result.structured_content


def _suggested(diagnosis: dict[str, Any]) -> list[dict[str, Any]]:
    """The first two replay configs the diagnosis suggests (its `--mitigation NAME=VALUE` items, as configs)."""
    configs = []
    for step in diagnosis["next_steps"]:
        name, value = step["mitigation"].split("=", 1)
        config = {name: value}
        if not step.get("diagnostic_only") and config not in configs:
            configs.append(config)
    assert configs, diagnosis["next_steps"]
    return configs[:2]


def _over_mcp(roots: Path, workspace: Path) -> dict[str, Any]:
    cmd = server_command()
    params = StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])

    async def investigate() -> dict[str, Any]:
        async with Client(params) as client:
            listed = {t.name for t in (await client.list_tools()).tools}
            found = await _call(client, "resolve_job", {"job": JOB, "roots": [str(roots)]})
            out = found["roles"][0]["output_dir"]
            listing = await _call(client, "list_snapshots", {"output_dir": out})
            worst = max(listing["snapshots"], key=lambda s: s["spike_ratio"] or 0.0)["iteration"]
            kept = await _call(client, "preserve_snapshots", {"output_dir": out, "iteration": worst})
            snapshot = kept["preserved"][0]["path"]
            await _call(client, "task_open", {"job": JOB, "snapshot": snapshot})
            diagnosis = await _call(client, "diagnose_spike", {"snapshot": snapshot, "model": "always"})
            await _call(client, "replay", {"snapshot": snapshot})
            configs = _suggested(diagnosis)
            await _call(client, "sweep", {"snapshot": snapshot, "configs": configs, "plot": False})
            task = await _call(client, "task_show", {"job": JOB})
            cleared = [e for e in task["experiments"] if e["verdict"] == "cleared"]
            assert cleared, task["experiments"]
            rationale = "the diagnosis's first suggestion cleared the spike"
            await _call(
                client, "method_add", {"job": JOB, "attempt": cleared[0]["id"], "name": "m1", "rationale": rationale}
            )
            report = await _call(client, "write_report", {"job": JOB})
        return {"tools": listed, "iteration": worst, "configs": configs, "attempt": cleared[0]["id"], "report": report}

    return anyio.run(investigate)


def _over_cli(
    cli: Any, roots: Path, workspace: Path, iteration: int, configs: list[dict[str, Any]], attempt: str
) -> None:
    out = next(roots.glob(f"*~{JOB}__actor"))
    ws = ["--workspace", workspace]
    assert cli("preserve", out, "--iteration", iteration).code == 0
    snapshot = out / "checkpoints" / "spike_snapshots-active" / f"iter_{iteration:07d}"
    assert snapshot.is_dir()
    for argv in (
        ("task", "open", JOB, "--snapshot", snapshot, *ws),
        ("diagnose", snapshot, "--model", "always", *ws),
        ("replay", snapshot, *ws),
        (
            "sweep",
            snapshot,
            *[x for c in configs for x in ("--mitigation", " ".join(f"{k}={v}" for k, v in c.items()))],
            *ws,
        ),
        (
            "method",
            "add",
            "--job",
            JOB,
            "--attempt",
            attempt,
            "--name",
            "m1",
            "--rationale",
            "the diagnosis's first suggestion cleared the spike",
            *ws,
        ),
        ("report", JOB, *ws),
    ):
        done = cli(*argv)
        assert done.code == 0, (argv, done.err)


def _comparable(report: str, *roots: Path) -> str:
    """The report without what differs between two runs of the same steps: paths, times and wall seconds."""
    for root in roots:
        report = report.replace(str(root), "<root>")
    report = re.sub(r"\d{8}-\d{6}(-\d+)?", "<stamp>", report)
    report = re.sub(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?( UTC)?", "<time>", report)
    return re.sub(r"\d+(\.\d+)? ?s\b", "<s>", report)


def test_the_blind_investigation_over_the_lean_list_reaches_the_clis_report(captured_run, cli, tmp_path: Path) -> None:
    mcp_roots, cli_roots = tmp_path / "mcp-outputs", tmp_path / "cli-outputs"
    for roots in (mcp_roots, cli_roots):
        shutil.copytree(captured_run.output_dir.parent, roots)
    mcp_ws, cli_ws = tmp_path / "mcp-ws", tmp_path / "cli-ws"
    mcp_ws.mkdir()
    cli_ws.mkdir()

    seen = _over_mcp(mcp_roots, mcp_ws)
    assert {"diagnose_spike", "sweep", "method_add", "write_report"} <= seen["tools"]
    _over_cli(cli, cli_roots, cli_ws, seen["iteration"], seen["configs"], seen["attempt"])

    by_mcp = Path(seen["report"]["path"]).read_text()
    by_cli = (cli_ws / "tmp" / "spike-replay" / JOB / "report.md").read_text()
    assert "m1" in by_mcp and "cleared" in by_mcp
    assert _comparable(by_mcp, mcp_ws, mcp_roots) == _comparable(by_cli, cli_ws, cli_roots)
