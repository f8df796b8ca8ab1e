"""Tools for GPU nodes over SSH (faces over `remote/`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from axrl_spike_replay.mcp_faces.bridge import call_async_library
from axrl_spike_replay.mcp_faces.config import server_config
from axrl_spike_replay.mcp_faces.shared_arguments import AcceptNewKeyArg, RemotePythonArg, WorkspaceArg
from axrl_spike_replay.remote.nodes.node_probe import NodeReport

# Probing changes nothing on the node; it may record a new host key locally when asked to.
PROBE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=True)


async def probe_node_tool(
    target: Annotated[
        str,
        Field(
            description="The node, as typed (`ssh -p 22 user@host`, an alias, a spike-replay.yaml name).",
            min_length=1,
        ),
    ],
    ctx: Context,
    snapshot: Annotated[
        str | None,
        Field(description="A snapshot: does its full-fidelity replay fit there?"),
    ] = None,
    remote_python: RemotePythonArg = None,
    accept_new_host_key: AcceptNewKeyArg = False,
    workspace: WorkspaceArg = None,
) -> NodeReport:
    """Probe a GPU node over SSH (GPUs, versions, this package); with a snapshot, whether its replay fits there.

    Probe a GPU node over SSH (one connection, host key verified): GPU count, names and memory, driver,
    Python and torch versions, CUDA availability, whether axrl_spike_replay is importable there; with a
    snapshot, whether a full-fidelity replay fits or it will be reduced, and the plan. Run it before
    replaying on a node."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    path = str(config.path(snapshot)) if snapshot else None

    async def work(report: Callable[[str], None]) -> NodeReport:
        from axrl_spike_replay.remote.node import probe_node_async
        from axrl_spike_replay.remote.transport.options import RemoteOptions

        report(f"connecting to {target}")
        options = RemoteOptions(accept_new_host_key=accept_new_host_key)
        return await probe_node_async(target, remote_python, path, options=options, workspace=root, progress=report)

    return await call_async_library(ctx, work)


def register(server: MCPServer) -> None:
    """Add the node tools to `server`."""
    server.add_tool(probe_node_tool, name="probe_node", title="What a GPU node offers", annotations=PROBE)
