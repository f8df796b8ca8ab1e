"""The MCP tool server: one typed tool per step of a spike investigation, over the library's functions.

`create_server(workspace)` builds the server; `serve(...)` runs it over stdio (the default) or streamable
HTTP (TCP with a bearer token, see `mcp_faces.http_transport.http_access`; or a Unix socket that only this user can
use). The tools live in `mcp_faces/` (one module per area) and hold no logic of their own: they validate
their arguments, call one library function in a worker thread (progress and cancellation bridged) and
shape its result. Nothing heavy is imported until a tool needs it, so the server answers `tools/list` fast.

Each tool says what it does to the world in its annotations (readOnlyHint, destructiveHint, openWorldHint).
They are the one declaration `--read-only` goes by: a read-only server lists only the tools whose
readOnlyHint is true, and refuses a call to any other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from mcp.server.auth.provider import TokenVerifier
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.stdio import stdio_server
from mcp.types import Resource, Tool
from pydantic import AnyHttpUrl

from axrl_spike_replay import __version__
from axrl_spike_replay.agent_install import SERVER_NAME
from axrl_spike_replay.mcp_faces import (
    analysis_tools,
    capture_tools,
    plan_tools,
    record_tools,
    remote_tools,
    replay_tools,
    resources,
    snapshot_tools,
)
from axrl_spike_replay.mcp_faces.bridge import crash_error
from axrl_spike_replay.mcp_faces.config import ServerConfig
from axrl_spike_replay.mcp_faces.lean_tools import lean_tool
from axrl_spike_replay.mcp_faces.stdio_replies import AnsweringReadStream, RecordingLines, claimed_stdin

if TYPE_CHECKING:
    from axrl_spike_replay.mcp_faces.http_transport.http_access import HttpAccess

INSTRUCTIONS = """\
Investigate gradient-norm spikes of RL post-training runs (MoE LLMs) from their spike snapshots.
Order of work: resolve_job -> list_snapshots -> preserve_snapshots (at once, before rotation deletes them)
-> task_open -> inspect_snapshot / analyze_batch / top_param_grads / copy_and_scan_logs -> probe_node (when a
GPU node is given) -> replay (baseline; full fidelity when the node allows, else clearly reduced) -> sweep or
replay with mitigations (replay-only experiments, every attempt is logged in the task file) -> attribute_spike
-> method_add (proven, non-duplicate methods only) -> write_report -> release_preserved (at the very end).
Paths may be absolute or relative to the workspace; `workspace`, which most tools take, defaults to the server's.
The prompt `axrl-spike-replay` holds the whole workflow; resources axrl://task/{job} and axrl://method/{slug} show
the record. Tools are listed in brief: resource axrl://tool/{name} holds a tool's whole description and schemas,
axrl://arguments explains the arguments many tools share (placement, backend, Slurm, fidelity), and
axrl://mitigations every mitigation.
"""

TOOL_MODULES = (snapshot_tools, analysis_tools, replay_tools, plan_tools, remote_tools, record_tools, capture_tools)

# The token is made by this server itself: no OAuth endpoint is served (no provider, no resource URL), so
# the issuer named here appears nowhere; the SDK's settings only require one.
_LOCAL_ISSUER = "http://localhost"


def reads_only(tool: Tool) -> bool:
    """Whether a tool only reads (its readOnlyHint is true); a tool that does not say is taken to write."""
    return tool.annotations is not None and tool.annotations.read_only_hint is True


class SpikeReplayServer(MCPServer):
    """MCPServer whose resource list also names the task and method files present in the workspace; with
    `config.read_only`, it offers only the tools that read. Over HTTP, `token_verifier` lets a request in
    (the SDK's bearer middleware answers 401 before any session exists)."""

    def __init__(self, config: ServerConfig, token_verifier: TokenVerifier | None = None) -> None:
        auth = AuthSettings(issuer_url=AnyHttpUrl(_LOCAL_ISSUER), resource_server_url=None) if token_verifier else None
        super().__init__(
            SERVER_NAME,
            instructions=INSTRUCTIONS,
            version=__version__,
            log_level="WARNING",
            lifespan=_warm_lifespan,
            auth=auth,
            token_verifier=token_verifier,
        )
        self.config = config
        self.sessions = 0  # open lifespans (stdio: one; in-process clients: one each)

    async def run_stdio_async(self) -> None:
        """Serve over stdio, answering every request line, even one the SDK's transport cannot take (a lone
        surrogate, deep nesting, no method, a batch, an object id): see `mcp_faces.stdio_replies`, which also
        reads the lines the transport reads. The rest is the SDK's own `run_stdio_async`."""
        with claimed_stdin() as wire:
            stdin = RecordingLines(wire)
            async with stdio_server(stdin=stdin) as (read_stream, write_stream):
                lowlevel = self._lowlevel_server  # what the SDK's own run_stdio_async runs
                options = lowlevel.create_initialization_options()
                answering = AnsweringReadStream(read_stream, write_stream, stdin.lines)
                await lowlevel.run(answering, write_stream, options)

    async def list_tools(self) -> list[Tool]:
        """Every tool, lean (`mcp_faces.lean_tools`: the whole of each is the resource `axrl://tool/{name}`); a
        read-only server lists only those whose annotations say they only read."""
        tools = [lean_tool(t) for t in await self.full_tools()]
        return [t for t in tools if reads_only(t)] if self.config.read_only else tools

    async def full_tools(self) -> list[Tool]:
        """Every tool as registered: whole descriptions and schemas."""
        return await super().list_tools()

    async def list_resources(self) -> list[Resource]:
        """Static resources, then `axrl://task/<job>` and `axrl://method/<slug>` for each file there."""
        return [*await super().list_resources(), *resources.record_resources(self.config.workspace)]

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None) -> Any:
        """Call a tool; a crash outside the library bridge still tells the caller its type and message.

        The SDK would answer only `Error executing tool NAME`; the traceback goes to the server's log.
        A read-only server refuses a tool that does not only read, before anything runs.
        """
        if self.config.read_only:
            tool = next((t for t in await super().list_tools() if t.name == name), None)
            if tool is not None and not reads_only(tool):
                raise ToolError(
                    f"tool {name} is not offered: this server runs read-only (`mcp --read-only`), which offers only "
                    "the tools that read; it neither writes files nor runs replays nor reaches other machines"
                )
        try:
            return await super().call_tool(name, arguments, context)
        except UnexpectedToolError as exc:
            cause = exc.__cause__ or exc
            while isinstance(cause, UnexpectedToolError) and cause.__cause__ is not None:  # nested tool calls
                cause = cause.__cause__
            raise crash_error(cause, name) from exc


@asynccontextmanager
async def _warm_lifespan(server: Any) -> AsyncIterator[dict[str, Any]]:
    """The server's warm replay processes stop when its last session ends (stdio: when the client goes)."""
    server.sessions += 1
    try:
        yield {}
    finally:
        server.sessions -= 1
        warm = server.config.warm
        if server.sessions == 0 and warm is not None:
            await anyio.to_thread.run_sync(warm.close)


def create_server(
    workspace: str | Path | None = None,
    *,
    warm: bool = True,
    warm_memory: int | None = None,
    warm_idle_s: float | None = None,
    read_only: bool = False,
    token_verifier: TokenVerifier | None = None,
) -> SpikeReplayServer:
    """The server with every tool, resource and prompt; `workspace` (default: cwd) is the tools' default.

    `warm`: keep replay processes and loaded weights between calls (see `replay.jobs.warm_pool`); they stop
    when the server's session ends, or after `warm_idle_s` unused. `warm_memory`: bytes of loaded weights
    kept (default a quarter of RAM). `read_only`: offer only the tools that read. `token_verifier`: over
    HTTP, the bearer token a request must carry (see `mcp_faces.http_transport.http_access`).
    """
    from axrl_spike_replay.replay.jobs.warm_pool import DEFAULT_IDLE_S, WarmService

    service = WarmService(warm_memory, idle_s=warm_idle_s or DEFAULT_IDLE_S) if warm and not read_only else None
    config = ServerConfig(
        workspace=Path(workspace or Path.cwd()).expanduser().resolve(), warm=service, read_only=read_only
    )
    server = SpikeReplayServer(config, token_verifier)
    for module in TOOL_MODULES:
        module.register(server)
    resources.register(server, config)
    return server


def serve(
    workspace: str | Path | None = None,
    *,
    http: bool = False,
    host: str = "127.0.0.1",
    port: int = 8765,
    socket_path: Path | None = None,
    access: HttpAccess | None = None,
    ready: Callable[[], None] | None = None,
    read_only: bool = False,
    warm: bool = True,
    warm_memory: int | None = None,
    warm_idle_s: float | None = None,
) -> None:
    """Run the server until its client goes away (stdio) or it is interrupted (streamable HTTP at /mcp, on
    `host:port`, or on the Unix socket `socket_path`). Over HTTP, `access` says who is let in (its token);
    None lets in anyone who can connect. `ready` runs once the HTTP server's socket is bound."""
    verifier = access.verifier() if access is not None and (http or socket_path is not None) else None
    server = create_server(
        workspace,
        warm=warm,
        warm_memory=warm_memory,
        warm_idle_s=warm_idle_s,
        read_only=read_only,
        token_verifier=verifier,
    )
    on_stop = access.close if access is not None else None
    try:
        if socket_path is not None:
            from axrl_spike_replay.mcp_faces.http_transport.http_serve import serve_unix

            serve_unix(server, socket_path, ready=ready, on_stop=on_stop)
        elif http:
            from axrl_spike_replay.mcp_faces.http_transport.http_serve import serve_tcp

            serve_tcp(server, host, port, ready=ready, on_stop=on_stop)
        else:
            server.run("stdio")
    finally:
        if server.config.warm is not None:
            server.config.warm.close()
