"""CLI verbs for agents: `mcp` runs the MCP tool server, `install` puts skills and server into an agent."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

from axrl_spike_replay.cli.output import add_json_flag, emit, progress
from axrl_spike_replay.errors import ConfigError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(sub: Any) -> None:
    """Add `mcp` and `install`."""
    mcp = sub.add_parser(
        "mcp",
        help="run the MCP tool server (stdio by default, or streamable HTTP)",
        description="Run the MCP tool server for coding agents: stdio by default, or streamable HTTP at "
        "http://HOST:PORT/mcp with --http.",
    )
    mcp.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    mcp.add_argument("--port", type=int, default=8765, help="HTTP port (default 8765)")
    mcp.add_argument("--workspace", default=None, help="default workspace of the tools (default: current directory)")
    mcp.set_defaults(handler=_mcp)

    install = sub.add_parser(
        "install",
        help="install the agent skills and register the MCP server (.claude/skills, .mcp.json)",
        description="Copy the agent skills into PROJECT/.claude/skills/ and add this MCP server to PROJECT/.mcp.json "
        "(or ~/.claude/skills/ and ~/.claude.json with --user). Other servers are kept; running it again is safe.",
    )
    install.add_argument("--dir", dest="project_dir", default=None, help="project directory (default: current)")
    install.add_argument("--user", action="store_true", help="install for the user instead of one project")
    install.add_argument("--dry-run", action="store_true", help="show what would change, write nothing")
    add_json_flag(install)
    install.set_defaults(handler=_install)


def _mcp(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port (1-65535)")
    if args.workspace is not None and not Path(args.workspace).expanduser().is_dir():
        raise ConfigError(f"--workspace {args.workspace}: not an existing directory")
    from axrl_spike_replay.server import serve

    # A server stops at once on SIGTERM, whatever its tools' worker threads are doing: their rank
    # processes die with it and a watcher removes their temp dirs (see rank_processes).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.http:
        progress(f"MCP server (streamable HTTP) at http://{args.host}:{args.port}/mcp")
        if args.host not in LOOPBACK:
            progress(f"warning: {args.host} is not loopback and the server has no authentication")

    serve(args.workspace, http=args.http, host=args.host, port=args.port)
    return 0


def _install(args: argparse.Namespace) -> int:
    from axrl_spike_replay.agent_install import install

    result = install(args.project_dir, user=args.user, dry_run=args.dry_run)
    emit(result, args.json, _render_install)
    return 0


def _render_install(result: Any) -> str:
    verb = "would" if result.dry_run else "did"
    lines = [f"install ({result.scope}{', dry run' if result.dry_run else ''}): skills -> {result.skills_dir}"]
    lines.append(f"MCP server {result.server_name!r} -> {result.config_file}")
    counts: dict[str, int] = {}
    for change in result.changes:
        counts[change.action] = counts.get(change.action, 0) + 1
        if change.action != "unchanged":
            lines.append(f"  {change.action:7s} {change.path}")
    summary = ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
    lines.append(f"{verb}: {summary}" if result.changed else "already installed: nothing to change")
    if result.config_diff:
        lines.append(result.config_diff.rstrip("\n"))
    return "\n".join(lines)
