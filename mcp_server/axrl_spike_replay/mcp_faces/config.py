"""What every tool module shares: the server's settings (`server_config(ctx)` in a tool) and the argument types used
by many tools."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from mcp.server.mcpserver import Context
from pydantic import Field

from axrl_spike_replay.mcp_faces.bridge import resolve_in

if TYPE_CHECKING:
    from axrl_spike_replay.replay.jobs.warm_pool import WarmService


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server instance."""

    workspace: Path
    # Warm replay processes kept between calls (None: every local replay spawns its own, as the CLI does).
    # Its memory budget and idle timeout are the server's options (`mcp --warm-memory --warm-idle-timeout`).
    warm: WarmService | None = field(default=None, compare=False)
    # Offer only the tools that read (`mcp --read-only`): the tools' readOnlyHint says which.
    read_only: bool = False

    def workspace_for(self, given: str | None) -> Path:
        """The workspace a call works in: the one given (relative to the server's), else the server's."""
        return resolve_in(self.workspace, given) if given else self.workspace

    def path(self, given: str) -> Path:
        """A path argument: absolute as given, else relative to the server's workspace."""
        return resolve_in(self.workspace, given)


def server_config(ctx: Context[Any, Any]) -> ServerConfig:
    """The settings of the server a tool call came to (`server.SpikeReplayServer.config`)."""
    config = getattr(ctx.mcp_server, "config", None)
    if not isinstance(config, ServerConfig):
        raise TypeError(f"{type(ctx.mcp_server).__name__} carries no ServerConfig: build it with create_server")
    return config


OutputDirArg = Annotated[
    str,
    Field(
        description="A role output dir `<run>~<job>__<role>` (from resolve_job).",
        min_length=1,
    ),
]
JobArg = Annotated[
    str,
    Field(description="Job name (a plain name).", min_length=1),
]
TopArg = Annotated[int, Field(description="How many to return.", ge=1, le=1000)]
