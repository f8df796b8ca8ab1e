"""Tools that find, preserve, release and read snapshots (faces over `snapshot/`)."""

from __future__ import annotations

import os
import threading
from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from axrl_spike_replay.mcp_faces.bridge import Progress, call_library
from axrl_spike_replay.mcp_faces.config import JobArg, OutputDirArg, server_config
from axrl_spike_replay.mcp_faces.shared_arguments import SnapshotArg
from axrl_spike_replay.snapshot.discovery import OUTPUT_ROOTS_ENV, JobResolution, resolve_job
from axrl_spike_replay.snapshot.inspect import SnapshotInspection
from axrl_spike_replay.snapshot.legacy import PreparedSnapshot, prepare_replay_dir
from axrl_spike_replay.snapshot.listing import SnapshotListing, list_snapshots
from axrl_spike_replay.snapshot.preservation.preserve import PreserveResult, ReleaseResult, preserve, release

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)

RootsArg = Annotated[
    list[str],
    Field(
        description="Dirs holding the job's output dirs; also $AXRL_OUTPUT_ROOTS, else the workspace.",
    ),
]

IterationArg = Annotated[
    int | None,
    Field(description="N of iter_<N>; omit for all.", ge=0),
]

IntoWorkspaceArg = Annotated[
    bool,
    Field(description="Preserve into the workspace: nothing written under the output root."),
]


async def resolve_job_tool(job: JobArg, ctx: Context, roots: RootsArg = []) -> JobResolution:  # noqa: B006
    """Find a job's role output dirs and log files. Start here.

    Find every role output directory (`<run>~<job>__<role>`: actor, critic, ...) of a job and its log
    files. Start here; then list_snapshots on the role's output_dir."""
    config = server_config(ctx)
    search = [str(config.path(r)) for r in roots]
    if not search and not os.environ.get(OUTPUT_ROOTS_ENV):
        search = [str(config.workspace)]
    return await call_library(ctx, lambda progress, cancel: resolve_job(job, search))


async def list_snapshots_tool(output_dir: OutputDirArg, ctx: Context) -> SnapshotListing:
    """List an output dir's spike snapshots (rotating and preserved) with iteration, grad norm and spike ratio.

    List the spike snapshots of one output dir: the rotating ones (checkpoints/spike_snapshots, deleted by
    rotation) and preserved copies (checkpoints/spike_snapshots-active, and those preserve_snapshots made in
    the workspace, marked `in_workspace`), with iteration, size, grad norm and spike ratio. Preserve the one you
    investigate at once with preserve_snapshots."""
    config = server_config(ctx)
    return await call_library(
        ctx, lambda progress, cancel: list_snapshots(config.path(output_dir), workspace=config.workspace)
    )


async def preserve_snapshots_tool(
    output_dir: OutputDirArg,
    ctx: Context,
    iteration: IterationArg = None,
    into_workspace: IntoWorkspaceArg = False,
) -> PreserveResult:
    """Preserve snapshots as hardlinked copies that rotation never deletes. Do it first, at once; work on the copy.

    Preserve retained snapshots (one iteration, or all) as hardlinked copies under
    checkpoints/spike_snapshots-active/, which rotation never deletes. Do this first, at once. Cheap
    (hardlinks; a real copy only across filesystems), idempotent, never modifies the source. Work on the
    preserved path from then on; release_preserved removes the copy at the very end. When the output root is
    not writable, or with into_workspace (the user asked for no writes there), the copies go into the workspace
    (preserved-snapshots/<output dir name>/): hardlinks where the filesystem allows, copies otherwise, free
    space checked first; `in_workspace` and `reason` say so."""
    config = server_config(ctx)

    def work(progress: Progress, cancel: threading.Event) -> PreserveResult:
        what = f"iteration {iteration}" if iteration is not None else "every retained snapshot"
        progress.message(f"preserving {what} of {output_dir}")
        result = preserve(
            config.path(output_dir),
            iteration,
            progress=progress.message,
            workspace=config.workspace,
            no_writes=into_workspace,
        )
        progress.message(f"preserved {len(result.preserved)}, failed {len(result.failed)}")
        return result

    return await call_library(ctx, work)


async def release_preserved_tool(
    output_dir: OutputDirArg,
    ctx: Context,
    iteration: IterationArg = None,
    in_workspace: Annotated[bool, Field(description="Release the copies made in the workspace.")] = False,
) -> ReleaseResult:
    """Delete preserved copies made by preserve_snapshots, only at the very end (after write_report).

    Delete preserved copies made by preserve_snapshots (one iteration, or all) — only at the very end,
    after write_report. Refuses anything that is not a preserved copy made by this tool; retained
    snapshots under checkpoints/spike_snapshots are never touched."""
    config = server_config(ctx)
    workspace = config.workspace if in_workspace else None
    return await call_library(
        ctx, lambda progress, cancel: release(config.path(output_dir), iteration, workspace=workspace)
    )


async def inspect_snapshot_tool(snapshot: SnapshotArg, ctx: Context) -> SnapshotInspection:
    """Read a snapshot's metadata, settings, per-rank contents and model size; list its problems (no weights read).

    Read a snapshot's metadata (iteration, job, role, world size, tp/pp/dp/ep/etp/cp, grad norm, median
    norm, spike ratio, legacy layout or not), per-rank batch and routing-payload counts, the model size
    from the checkpoint metadata, the run config's loss, routing and parallel sections and the detector as
    recorded (`settings`), and list its problems (missing rank files, inconsistent world size, and `[input]`
    lines: a rank's routes, tokens, mask or stored log-probs failing a check against the run config's model,
    also under `input_findings`). Reads headers and those small tensors only, so it is fast on snapshots of
    hundreds of GB."""
    config = server_config(ctx)
    from axrl_spike_replay.replay.reading.input_checks import inspect_with_inputs  # imports torch: only when it runs

    return await call_library(ctx, lambda progress, cancel: inspect_with_inputs(config.path(snapshot)))


async def prepare_replay_dir_tool(
    snapshot: SnapshotArg,
    ctx: Context,
    dest: Annotated[
        str | None,
        Field(description="Empty or new dir for it; default: a new temporary dir."),
    ] = None,
) -> PreparedSnapshot:
    """Make a replay dir for a legacy-layout snapshot (replay calls it itself when needed).

    For a legacy snapshot (AXRL keys in metadata.json, which breaks checkpoint loading), make a replay
    dir of hardlinks with a restored checkpoint metadata.json and axrl_metadata.json; the original is never
    touched. A current-layout snapshot needs nothing (replay_dir is the snapshot). replay calls this
    itself when needed."""
    config = server_config(ctx)
    target = config.path(dest) if dest else None
    return await call_library(ctx, lambda progress, cancel: prepare_replay_dir(config.path(snapshot), target))


def register(server: MCPServer) -> None:
    """Add the snapshot tools to `server`."""
    server.add_tool(
        resolve_job_tool, name="resolve_job", title="Find a job's output directories", annotations=READ_ONLY
    )
    server.add_tool(
        list_snapshots_tool, name="list_snapshots", title="List a role's spike snapshots", annotations=READ_ONLY
    )
    server.add_tool(
        preserve_snapshots_tool,
        name="preserve_snapshots",
        title="Preserve snapshots",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False
        ),
    )
    server.add_tool(
        release_preserved_tool,
        name="release_preserved",
        title="Delete preserved copies",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False
        ),
    )
    server.add_tool(
        inspect_snapshot_tool,
        name="inspect_snapshot",
        title="Read a snapshot's metadata and files",
        annotations=READ_ONLY,
    )
    server.add_tool(
        prepare_replay_dir_tool,
        name="prepare_replay_dir",
        title="Prepare a legacy snapshot for replay",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
        ),
    )
