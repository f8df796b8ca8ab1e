"""docs/mcp.md is the MCP face's page: it lists every tool and resource the server offers (asked of the server
itself, over a real client session), shows how to try it with the MCP Inspector, and links the HTTP set-up."""

from __future__ import annotations

from pathlib import Path

from server_helpers import with_client

from axrl_spike_replay.server import create_server

PAGE = Path(__file__).resolve().parents[2] / "docs" / "mcp.md"


def test_the_mcp_page_lists_every_tool_and_resource_the_server_offers(workspace: Path) -> None:
    server = create_server(workspace)
    tools = with_client(server, lambda client: client.list_tools()).tools
    templates = with_client(server, lambda client: client.list_resource_templates()).resource_templates
    text = PAGE.read_text(encoding="utf-8")
    assert [t.name for t in tools if f"| `{t.name}` |" not in text] == []
    assert [t.uri_template for t in templates if f"`{t.uri_template}`" not in text] == []
    assert "`axrl://mitigations`" in text and "`axrl://methods`" in text


def test_the_mcp_page_shows_the_inspector_command_lines_and_links_the_http_setup() -> None:
    text = PAGE.read_text(encoding="utf-8")
    npx = "npx -y @modelcontextprotocol/inspector@0.22.0"  # the version test.sh installs, without a prompt
    assert f"{npx} .venv/bin/axrl-spike-replay mcp\n" in text
    assert f"{npx} --cli .venv/bin/axrl-spike-replay mcp --method tools/list" in text
    assert "(mcp-http.md)" in text
