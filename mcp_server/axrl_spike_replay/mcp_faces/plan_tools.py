"""`plan_replay`: what a replay needs per process and whether it fits, before anything loads (a face over
`investigation.planning`)."""

from __future__ import annotations

import threading
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from axrl_spike_replay.investigation.node_description import MAX_GPU_MEMORY_GIB, MAX_GPUS
from axrl_spike_replay.mcp_faces.bridge import Progress, call_library
from axrl_spike_replay.mcp_faces.config import server_config
from axrl_spike_replay.mcp_faces.shared_arguments import (
    AcceptNewKeyArg,
    DeviceArg,
    NprocArg,
    RemotePythonArg,
    ShardArg,
    SnapshotArg,
    WorkspaceArg,
)

# Reads the snapshot's metadata and shapes; with a target, probes that node over SSH (open world), and may record
# its new host key when asked to (so, as `probe_node`, not read-only).
PLANS = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=True)


async def plan_replay_tool(
    snapshot: SnapshotArg,
    ctx: Context,
    target: Annotated[
        str | None,
        Field(description="Plan for this node's GPUs (probed over SSH); omit: this machine."),
    ] = None,
    nproc: NprocArg = None,
    device: DeviceArg = "cpu",
    shard: ShardArg = "auto",
    gpus: Annotated[
        int | None,
        Field(description="A node of this many GPUs (with gpu_memory_gib).", ge=1, le=MAX_GPUS),
    ] = None,
    gpu_memory_gib: Annotated[
        float | None,
        Field(description="Each GPU's memory in GiB (with gpus).", gt=0, le=MAX_GPU_MEMORY_GIB, allow_inf_nan=False),
    ] = None,
    remote_python: RemotePythonArg = None,
    accept_new_host_key: AcceptNewKeyArg = False,
    workspace: WorkspaceArg = None,
) -> dict[str, Any]:
    """Before a replay: memory per process, whether it fits here or on a node, the smallest full-fidelity layout.

    Before a replay: parameters, gradients and peak activation memory per process for N processes in the
    precision that runs (model built on the meta device from the snapshot's run config; no weight read, so a
    config-only snapshot is enough); whether that fits this machine, the target's GPUs or the node described;
    the smallest N for full fidelity and the layout it suggests. `summary` says it in words. A replay that
    cannot fit is refused with this plan."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    path = config.path(snapshot)

    def work(progress: Progress, cancel: threading.Event) -> dict[str, Any]:
        from axrl_spike_replay.investigation.planning import plan_for
        from axrl_spike_replay.remote.transport.options import RemoteOptions

        plan = plan_for(
            path,
            target=target,
            nproc=nproc,
            device=device,
            shard=shard,
            gpus=gpus,
            gpu_memory_gib=gpu_memory_gib,
            workspace=root,
            options=RemoteOptions(remote_python=remote_python, accept_new_host_key=accept_new_host_key),
            progress=progress.message,
        )
        return {**plan.to_json(), "summary": plan.text()}

    return await call_library(ctx, work)


def register(server: MCPServer) -> None:
    """Add `plan_replay` to `server`."""
    server.add_tool(plan_replay_tool, name="plan_replay", title="Plan a replay's memory and layout", annotations=PLANS)
