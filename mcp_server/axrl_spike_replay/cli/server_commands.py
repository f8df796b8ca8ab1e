"""CLI verbs for long-lived servers and agents: `mcp` runs the MCP tool server, `mcp-token` prints the header its
HTTP clients send, `serve` runs the CLI's warm replay service, `install` puts skills and server into an agent."""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import signal
from pathlib import Path
from typing import Any

from axrl_spike_replay.cli.output import add_json_flag, emit, progress
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.warm_socket import DEFAULT_SEND_TIMEOUT_S
from axrl_spike_replay.replay.jobs.warm_pool import DEFAULT_IDLE_S


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
        description="Run the MCP tool server for coding agents: stdio by default; streamable HTTP at "
        "http://HOST:PORT/mcp with --http, where every request must carry the bearer token the server writes "
        "to a file only this user can read (see `mcp-token`); or streamable HTTP on a Unix socket that only "
        "this user can use with --socket.",
    )
    mcp.add_argument("--http", action="store_true", help="serve streamable HTTP on TCP instead of stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    mcp.add_argument("--port", type=int, default=8765, help="HTTP port (default 8765)")
    mcp.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="HTTP: the bearer token clients must send, read from FILE (this user's, mode 0600, not a symlink); "
        "default: a new token each start, written to ~/.local/state/axrl-spike-replay/mcp-http-PORT.token",
    )
    mcp.add_argument(
        "--no-auth",
        action="store_true",
        help="HTTP on a loopback address only: ask no token, so ANY local user can call every tool as you",
    )
    mcp.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="serve streamable HTTP on a Unix socket at PATH instead (mode 0600; connections from other users "
        "are refused; only a socket of yours left at PATH is replaced); clients use http://localhost/mcp over it",
    )
    mcp.add_argument(
        "--read-only",
        action="store_true",
        help="offer only the tools that read (their readOnlyHint); calls to any other tool are refused",
    )
    mcp.add_argument("--workspace", default=None, help="default workspace of the tools (default: current directory)")
    mcp.add_argument(
        "--no-warm", action="store_true", help="spawn replay processes for every call instead of keeping them warm"
    )
    _add_warm_options(mcp, "warm replays")
    mcp.set_defaults(handler=_mcp)

    token = sub.add_parser(
        "mcp-token",
        help="print the header an HTTP client of `mcp --http` sends (for headersHelper, the Inspector, curl)",
        description="Read the bearer token of a running `mcp --http` server (checked: this user's file, private) "
        'and print the headers to send: as JSON {"Authorization": "Bearer ..."} (what Claude Code\'s '
        "headersHelper reads), or with --header as one `Authorization: Bearer ...` line (for the MCP Inspector's "
        "--header or curl -H).",
    )
    token.add_argument("--port", type=int, default=8765, help="the server's port (default 8765)")
    token.add_argument("--token-file", default=None, metavar="FILE", help="the server's --token-file, if it has one")
    token.add_argument("--header", action="store_true", help="print one `Authorization: Bearer ...` line")
    token.set_defaults(handler=_mcp_token)

    serve = sub.add_parser(
        "serve",
        help="run the warm replay service that `replay`/`sweep`/`attribute --warm` use (foreground)",
        description="Keep replay processes (torch imported, process group up) and snapshot weights loaded for "
        "later CLI calls with --warm, which reach this service over a Unix socket only this user can use "
        "(WORKSPACE/tmp/spike-replay-warm/serve.sock, or in this user's runtime dir, $XDG_RUNTIME_DIR or "
        "/tmp/axrl-spike-replay-UID, for a long path). `--warm` "
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
    install.add_argument(
        "--http",
        nargs="?",
        const="http://127.0.0.1:8765/mcp",
        default=None,
        metavar="URL",
        help="register a running `mcp --http` server at URL (default http://127.0.0.1:8765/mcp) instead of "
        "stdio; the agent gets its token from `mcp-token` (headersHelper), never from the config file",
    )
    install.add_argument(
        "--token-file", default=None, metavar="FILE", help="with --http: the server's --token-file, if it has one"
    )
    add_json_flag(install)
    install.set_defaults(handler=_install)


def _mcp(args: argparse.Namespace) -> int:
    from axrl_spike_replay.mcp_faces.http_transport.http_access import check_bind, http_access

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port (1-65535)")
    if args.workspace is not None and not Path(args.workspace).expanduser().is_dir():
        raise ConfigError(f"--workspace {args.workspace}: not an existing directory")
    if args.http and args.socket is not None:
        raise ConfigError("give --http (TCP) or --socket PATH (a Unix socket), not both")
    over_http = args.http or args.socket is not None
    if not over_http and (args.no_auth or args.token_file is not None):
        raise ConfigError("--no-auth and --token-file are options of HTTP: add --http (or --socket PATH)")
    if args.http:
        check_bind(args.host, no_auth=args.no_auth, token_file=args.token_file)
    from axrl_spike_replay.server import serve

    memory = parse_size(args.warm_memory) if args.warm_memory is not None else None
    # A server stops at once on SIGTERM, whatever its tools' worker threads are doing: their rank
    # processes die with it and a watcher removes their temp dirs (see rank_processes).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Over a Unix socket the kernel names the peer, so a token is asked only when one is given.
    no_token = args.no_auth or (args.socket is not None and args.token_file is None)
    with http_access(args.port, no_auth=no_token, token_file=args.token_file) if over_http else _no_access() as access:

        def ready() -> None:  # the socket is bound: the token file is this server's now, and said where it is
            access.publish()
            _announce(args, access)

        serve(
            args.workspace,
            http=args.http,
            host=args.host,
            port=args.port,
            socket_path=Path(args.socket).expanduser().absolute() if args.socket is not None else None,
            access=access,
            ready=ready if access is not None else None,
            read_only=args.read_only,
            warm=not args.no_warm,
            warm_memory=memory,
            warm_idle_s=args.warm_idle_timeout,
        )
    return 0


@contextlib.contextmanager
def _no_access() -> Any:
    yield None


def _announce(args: argparse.Namespace, access: Any) -> None:
    """What a person starting an HTTP server must know: where it listens, who may use it, how clients get in."""
    from axrl_spike_replay.mcp_faces.http_transport.http_access import is_loopback, url_host

    user = f"{getpass.getuser()} (uid {os.getuid()})"
    if args.socket is not None:
        progress(f"MCP server (streamable HTTP) on the Unix socket {args.socket}: http://localhost/mcp over it")
        progress(f"only {user} may connect (socket mode 0600, each peer's user id checked)")
    else:
        progress(f"MCP server (streamable HTTP) at http://{url_host(args.host)}:{args.port}/mcp")
    if access.token is not None:
        which = f"--token-file {access.token_file}" if args.token_file is not None else f"--port {args.port}"
        progress(f"bearer token in {access.token_file} (readable by {user} only); clients send the header")
        progress(f'  Authorization: Bearer <token>, e.g. --header "$(axrl-spike-replay mcp-token {which} --header)"')
        if args.socket is None and not is_loopback(args.host):
            progress(
                f"warning: {args.host} is not loopback and this is plain HTTP: the token crosses the network "
                "readable by anyone on the way; prefer 127.0.0.1 and an SSH tunnel (ssh -L)"
            )
    elif args.socket is None:
        progress(
            "WARNING: --no-auth: this server asks no token. ANY process of ANY user on this machine can call every "
            f"tool as {user}: read any file that user can read, write the workspace, run replays on the GPUs and "
            "reach SSH targets with that user's keys. Use it only on a machine no one else can log in to."
        )
    if args.read_only:
        progress("read-only: only the tools that read are offered; calls to the others are refused")


def _mcp_token(args: argparse.Namespace) -> int:
    from axrl_spike_replay.mcp_faces.http_transport.http_access import bearer_headers, default_token_file, read_token

    if args.token_file is None and not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port (1-65535)")
    path = args.token_file if args.token_file is not None else default_token_file(args.port)
    if args.token_file is None and not Path(path).exists():
        raise ConfigError(f"no token file at {path}: is `axrl-spike-replay mcp --http --port {args.port}` running?")
    headers = bearer_headers(read_token(path))
    if args.header:
        print(*(f"{name}: {value}" for name, value in headers.items()), sep="\n")
    else:
        print(json.dumps(headers))
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
    from axrl_spike_replay.agent_install import http_entry, install

    if args.token_file is not None and args.http is None:
        raise ConfigError("--token-file goes with --http: it names the token file of the HTTP server registered")
    entry = http_entry(args.http, args.token_file) if args.http is not None else None
    result = install(args.project_dir, user=args.user, dry_run=args.dry_run, entry=entry)
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
