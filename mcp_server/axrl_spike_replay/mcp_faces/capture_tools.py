"""Tools for the capture side (faces over `capture/`)."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from axrl_spike_replay.capture.checkpoint_interval import CheckpointIntervalAdvice, checkpoint_interval
from axrl_spike_replay.mcp_faces.bridge import call_library

PURE = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)


async def checkpoint_interval_tool(
    checkpoint_cost_s: Annotated[float, Field(description="Seconds one checkpoint takes to write.", gt=0)],
    mtbf_steps: Annotated[
        float, Field(description="Mean steps between spikes that force a rollback (e.g. 2000).", gt=0)
    ],
    step_time_s: Annotated[float, Field(description="Seconds per training step.", gt=0)],
    ctx: Context,
) -> CheckpointIntervalAdvice:
    """How often to checkpoint when spikes force rollbacks (Young-Daly), with the overhead around the optimum.

    How often to checkpoint when spikes force rollbacks: the Young-Daly optimum
    K* = sqrt(2 * checkpoint_cost * mtbf_steps / step_time) steps, with the expected overhead (checkpoint
    writing plus rework after a rollback) at K* and at a few intervals around it. Example: 20 s checkpoints,
    a spike every 2000 steps, 1 s steps -> K* ~ 283."""
    return await call_library(
        ctx, lambda progress, cancel: checkpoint_interval(checkpoint_cost_s, mtbf_steps, step_time_s)
    )


def register(server: MCPServer) -> None:
    """Add the capture tools to `server`."""
    server.add_tool(
        checkpoint_interval_tool, name="checkpoint_interval", title="Young-Daly checkpoint interval", annotations=PURE
    )
