"""What an agent sees when it connects: the tools with typed, described parameters, output schemas and honest
annotations, over real stdio and over streamable HTTP on loopback; and a server that starts without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from http_helpers import bearer, http_server, refused_start, with_http_client
from mcp import StdioServerParameters
from server_helpers import server_command, with_client

from axrl_spike_replay.mcp_faces.lean_tools import hint
from axrl_spike_replay.server import INSTRUCTIONS

ALL_TOOLS = {
    "diagnose_spike",
    "resolve_job",
    "copy_and_scan_logs",
    "list_snapshots",
    "preserve_snapshots",
    "release_preserved",
    "inspect_snapshot",
    "analyze_batch",
    "top_param_grads",
    "prepare_replay_dir",
    "probe_node",
    "plan_replay",
    "replay",
    "sweep",
    "attribute_spike",
    "task_open",
    "task_note",
    "task_show",
    "method_add",
    "method_list",
    "write_report",
    "checkpoint_interval",
}
READ_ONLY = {
    "diagnose_spike",
    "resolve_job",
    "list_snapshots",
    "inspect_snapshot",
    "analyze_batch",
    "top_param_grads",
    "task_show",
    "method_list",
    "checkpoint_interval",
}
# replay and sweep: with the command backend they run the node's trainer, with a patch the caller chose
DESTRUCTIVE = {"release_preserved", "write_report", "replay", "sweep"}
OPEN_WORLD = {"probe_node", "plan_replay", "replay", "sweep"}


def stdio_params(workspace: Path) -> StdioServerParameters:
    cmd = server_command()
    return StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])


def test_tools_over_stdio_have_described_parameters_schemas_and_annotations(workspace: Path) -> None:
    """The lean list still says what each argument is: in its schema, by its choices, or (`workspace`) once in the
    server's instructions; hints the list leaves out say MCP's defaults, which are what these tools do."""
    listed = with_client(stdio_params(workspace), lambda client: client.list_tools())
    tools = {t.name: t for t in listed.tools}
    assert set(tools) == ALL_TOOLS
    for name, tool in tools.items():
        assert tool.description and len(tool.description) > 40, name
        props = tool.input_schema.get("properties", {})
        for arg, schema in props.items():
            said = schema.get("description") or schema.get("enum") or f"`{arg}`" in INSTRUCTIONS
            assert said, f"{name}.{arg} is not described"
        assert tool.output_schema and tool.output_schema.get("type") == "object", name
        assert hint(tool.annotations, "read_only_hint") == (name in READ_ONLY), name
        assert hint(tool.annotations, "destructive_hint") == (name in DESTRUCTIVE), name
        if name in OPEN_WORLD:
            assert hint(tool.annotations, "open_world_hint"), name


def test_importing_the_server_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from axrl_spike_replay.server import create_server\n"
        "create_server('.')\n"
        "heavy = sorted(m for m in ('torch', 'matplotlib', 'numpy', 'asyncssh') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" not in out.stdout.split(","), out.stdout
    assert "matplotlib" not in out.stdout.split(","), out.stdout


def test_streamable_http_answers_on_loopback_with_its_token(workspace: Path, tmp_path: Path) -> None:
    with http_server(workspace, tmp_path / "state") as server:
        listed = with_http_client(server.url, lambda client: client.list_tools(), bearer(server.token))
        assert {t.name for t in listed.tools} == ALL_TOOLS
        result = with_http_client(
            server.url,
            lambda client: client.call_tool("inspect_snapshot", {"snapshot": "no-such-snapshot"}),
            bearer(server.token),
        )
        assert result.is_error and "no-such-snapshot" in result.content[0].text


@pytest.mark.parametrize("port", ["0", "70000"])
def test_mcp_refuses_a_port_that_is_not_one(port: str) -> None:
    out = refused_start("--http", "--port", port)
    assert out.returncode == 2
    assert "--port" in out.stderr and "Traceback" not in out.stderr
