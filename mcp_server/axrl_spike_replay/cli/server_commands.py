"""CLI verbs for long-lived servers and agents: `mcp` runs the MCP tool server, `serve` the CLI's warm replay
service, `install` puts skills and server into an agent."""

from __future__ import annotations

import argparse
import contextlib
import signal
from pathlib import Path
from typing import Any

from axrl_spike_replay.cli.output import add_json_flag, emit, progress
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.warm_socket import DEFAULT_SEND_TIMEOUT_S
from axrl_spike_replay.replay.warm_pool import DEFAULT_IDLE_S

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_size(text: str) -> int:
    """Bytes from `4G`, `512M`, `64K` or a plain number of bytes (binary units); ConfigError otherwise."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in units else raw
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(f"`warm_memory` must be a size like 4G, 512M or a number of bytes, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"`warm_memory` must be a size >= 0, got {text!r}")
    return int(value * scale)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _add_warm_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--warm-memory",
        default=None,
        metavar="SIZE",
        help=f"{what}: memory for loaded snapshot weights, over all replay processes (e.g. 4G; default a quarter "
        "of RAM); least recently used first out",
    )
    parser.add_argument(
        "--warm-idle-timeout",
        type=_positive_seconds,
        default=DEFAULT_IDLE_S,
        metavar="S",
        help=f"{what}: replay processes unused this long are stopped (default {DEFAULT_IDLE_S:g})",
    )


def register(sub: Any) -> None:
    """Add `mcp`, `serve` and `install`."""
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
    mcp.add_argument(
        "--no-warm", action="store_true", help="spawn replay processes for every call instead of keeping them warm"
    )
    _add_warm_options(mcp, "warm replays")
    mcp.set_defaults(handler=_mcp)

    serve = sub.add_parser(
        "serve",
        help="run the warm replay service that `replay`/`sweep`/`attribute --warm` use (foreground)",
        description="Keep replay processes (torch imported, process group up) and snapshot weights loaded for "
        "later CLI calls with --warm, which reach this service over a Unix socket only this user can use "
        "(WORKSPACE/tmp/spike-replay-warm/serve.sock, or under $XDG_RUNTIME_DIR for a long path). `--warm` "
        "starts one on first use. It stops after --warm-idle-timeout seconds without a request, on --stop, "
        "SIGTERM or Ctrl-C, and its replay processes stop with it.",
    )
    serve.add_argument("--workspace", default=".", help="the workspace whose CLI calls it serves (default: .)")
    serve.add_argument("--stop", action="store_true", help="stop the service of this workspace and exit")
    serve.add_argument(
        "--send-timeout",
        type=_positive_seconds,
        default=DEFAULT_SEND_TIMEOUT_S,
        metavar="S",
        help="a client that leaves a reply unread this long (stopped, hung) counts as gone and its run is "
        f"cancelled (default {DEFAULT_SEND_TIMEOUT_S:g})",
    )
    _add_warm_options(serve, "the service")
    serve.set_defaults(handler=_serve)

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

    memory = parse_size(args.warm_memory) if args.warm_memory is not None else None
    # A server stops at once on SIGTERM, whatever its tools' worker threads are doing: their rank
    # processes die with it and a watcher removes their temp dirs (see rank_processes).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.http:
        progress(f"MCP server (streamable HTTP) at http://{args.host}:{args.port}/mcp")
        if args.host not in LOOPBACK:
            progress(f"warning: {args.host} is not loopback and the server has no authentication")

    serve(
        args.workspace,
        http=args.http,
        host=args.host,
        port=args.port,
        warm=not args.no_warm,
        warm_memory=memory,
        warm_idle_s=args.warm_idle_timeout,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from axrl_spike_replay.investigation.warm_client import stop_service
    from axrl_spike_replay.investigation.warm_daemon import ServiceSettings, serve_warm
    from axrl_spike_replay.investigation.warm_socket import warm_paths

    if not Path(args.workspace).expanduser().is_dir():
        raise ConfigError(f"--workspace {args.workspace}: not an existing directory")
    paths = warm_paths(args.workspace)
    if args.stop:
        pid = stop_service(paths)
        progress(f"stopped the warm replay service (pid {pid})" if pid else f"no warm replay service at {paths.socket}")
        return 0
    memory = parse_size(args.warm_memory) if args.warm_memory is not None else None
    with contextlib.suppress(KeyboardInterrupt):  # SIGTERM or Ctrl-C: a clean stop (serve_warm stops what it started)
        settings = ServiceSettings(idle_s=args.warm_idle_timeout, memory_bytes=memory, send_timeout_s=args.send_timeout)
        serve_warm(paths, settings, progress)
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
