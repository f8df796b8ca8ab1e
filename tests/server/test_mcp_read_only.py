"""`mcp --read-only` offers only the tools whose annotations say they only read, and refuses a call to any other
before it runs: a real stdio server process and client, and one in-process server with every tool called."""

from __future__ import annotations

from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters
from server_helpers import JOB, SpikeOutputs, error_text, server_command, with_client

from axrl_spike_replay.mcp_faces.lean_tools import hint
from axrl_spike_replay.server import create_server

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


def test_a_read_only_server_lists_only_reading_tools_and_refuses_a_writing_one(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    cmd = server_command()
    params = StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--read-only", "--workspace", str(workspace)])

    async def session(client: Client) -> tuple[set[str], str, str]:
        listed = {t.name for t in (await client.list_tools()).tools}
        for tool in (await client.list_tools()).tools:
            assert tool.annotations is not None and tool.annotations.read_only_hint is True, tool.name
        copy = await client.call_tool("copy_and_scan_logs", {"logs": [str(spike_outputs.log)], "job": JOB})
        release = await client.call_tool("release_preserved", {"output_dir": str(spike_outputs.output_dir)})
        return listed, error_text(copy), error_text(release)

    listed, copy, release = with_client(params, session)
    assert listed == READ_ONLY
    for text, tool in ((copy, "copy_and_scan_logs"), (release, "release_preserved")):
        assert tool in text and "read-only" in text
    assert not (workspace / "tmp").exists()  # nothing was copied


def test_every_tool_a_read_only_server_withholds_is_refused_and_every_reading_tool_still_runs(workspace: Path) -> None:
    everything = create_server(workspace)
    read_only = create_server(workspace, read_only=True)

    async def main() -> tuple[set[str], dict[str, str], dict[str, str]]:
        async with Client(everything) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
        refused, answered = {}, {}
        async with Client(read_only) as client:
            for name in sorted(tools):
                result = await client.call_tool(name, {})
                text = result.content[0].text if result.content else ""
                (answered if name in READ_ONLY else refused)[name] = text
        return tools, refused, answered

    tools, refused, answered = anyio.run(main)
    assert tools > READ_ONLY
    assert all("read-only" in text for text in refused.values()), refused
    # the reading tools were called for real: they answer about their arguments, not about read-only mode
    assert not any("read-only" in text for text in answered.values()), answered


def test_the_docs_table_of_tools_says_what_their_annotations_say(workspace: Path) -> None:
    """docs/mcp-http.md lists every tool with what it may do; the annotations are the declaration it follows."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "mcp-http.md").read_text()
    rows = {}
    for line in docs.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 5:
            rows[cells[0].strip("`")] = tuple(c == "yes" for c in cells[1:4])

    async def annotations() -> dict[str, tuple[bool, bool, bool]]:
        async with Client(create_server(workspace)) as client:
            tools = (await client.list_tools()).tools
        # a hint the list leaves out says MCP's default (destructive, open world)
        names = ("read_only_hint", "destructive_hint", "open_world_hint")
        return {t.name: tuple(hint(t.annotations, name) for name in names) for t in tools}

    assert rows == anyio.run(annotations)
