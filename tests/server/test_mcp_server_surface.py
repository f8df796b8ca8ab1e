"""What an agent sees when it connects: the tools with typed, described parameters, output schemas and honest
annotations, over real stdio and over streamable HTTP on loopback; and a server that starts without torch."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mcp import StdioServerParameters
from server_helpers import server_command, with_client

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
DESTRUCTIVE = {"release_preserved", "write_report"}
OPEN_WORLD = {"probe_node", "replay", "sweep"}


def stdio_params(workspace: Path) -> StdioServerParameters:
    cmd = server_command()
    return StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])


def test_tools_over_stdio_have_described_parameters_schemas_and_annotations(workspace: Path) -> None:
    listed = with_client(stdio_params(workspace), lambda client: client.list_tools())
    tools = {t.name: t for t in listed.tools}
    assert set(tools) == ALL_TOOLS
    for name, tool in tools.items():
        assert tool.description and len(tool.description) > 40, name
        props = tool.input_schema.get("properties", {})
        for arg, schema in props.items():
            assert schema.get("description"), f"{name}.{arg} has no description"
        assert tool.output_schema and tool.output_schema.get("type") == "object", name
        notes = tool.annotations
        assert notes is not None, name
        assert None not in (
            notes.read_only_hint,
            notes.destructive_hint,
            notes.idempotent_hint,
            notes.open_world_hint,
        ), name
        assert notes.read_only_hint == (name in READ_ONLY), name
        assert notes.destructive_hint == (name in DESTRUCTIVE), name
        if name in OPEN_WORLD:
            assert notes.open_world_hint, name


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def test_streamable_http_answers_on_loopback(workspace: Path) -> None:
    port = _free_port()
    cmd = [
        *server_command(),
        "mcp",
        "--http",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workspace",
        str(workspace),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_port(port, proc)
        listed = with_client(f"http://127.0.0.1:{port}/mcp", lambda client: client.list_tools())
        assert {t.name for t in listed.tools} == ALL_TOOLS
        result = with_client(
            f"http://127.0.0.1:{port}/mcp",
            lambda client: client.call_tool("inspect_snapshot", {"snapshot": "no-such-snapshot"}),
        )
        assert result.is_error and "no-such-snapshot" in result.content[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("port", ["0", "70000"])
def test_mcp_refuses_a_port_that_is_not_one(port: str) -> None:
    out = subprocess.run([*server_command(), "mcp", "--http", "--port", port], capture_output=True, text=True)
    assert out.returncode == 2
    assert "--port" in out.stderr and "Traceback" not in out.stderr
