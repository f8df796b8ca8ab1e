"""Tools that keep the investigation record: task file, method files, report (faces over `workspace/`)."""

from __future__ import annotations

from typing import Annotated, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.mcp_faces.bridge import call_library
from axrl_spike_replay.mcp_faces.config import JobArg, server_config
from axrl_spike_replay.mcp_faces.record_models import MethodAdded, MethodList, ReportWritten, TaskView
from axrl_spike_replay.mcp_faces.shared_arguments import WorkspaceArg
from axrl_spike_replay.workspace.method_files.methods import add_method, list_methods
from axrl_spike_replay.workspace.report import write_report
from axrl_spike_replay.workspace.task_record.task_state import note, show_task

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)


async def task_open_tool(
    job: JobArg,
    ctx: Context,
    snapshot: Annotated[str | None, Field(description="Set the active snapshot (the preserved path).")] = None,
    diagnosis: Annotated[
        Literal["never", "auto", "always", "off"],
        Field(description="Diagnose a new snapshot into the task: never (no weights loaded), auto, always, off."),
    ] = "never",
    workspace: WorkspaceArg = None,
) -> TaskView:
    """Open (or re-open) the job's task file; a new snapshot is diagnosed into it. Every replay then logs itself there.

    Open (or re-open, keeping its history) the task file agent-task/spike-replay/<job>.md with sections
    Active snapshot, Replay command, Experiment table, Observations, Failed attempts, Next steps. A snapshot
    not diagnosed yet is diagnosed (as `diagnose_spike`): its likely causes go under Observations, the
    experiments to run under Next steps. Once open, every replay and sweep of the job logs itself into it."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    target = str(config.path(snapshot)) if snapshot else None
    return await call_library(
        ctx, lambda progress, cancel: _task_view(open_task(root, job, target, diagnosis=diagnosis))
    )


async def task_note_tool(
    job: JobArg,
    section: Annotated[
        Literal["observations", "next-steps"], Field(description="Which section of the task file to add to.")
    ],
    text: Annotated[str, Field(description="The note: what you saw or plan, with figures.", min_length=1)],
    ctx: Context,
    workspace: WorkspaceArg = None,
) -> TaskView:
    """Add a line to the task file's Observations or Next steps (replays log their own rows).

    Append a line to the Observations or Next steps of the job's task file (what the signals showed, why
    an attempt was dropped, what to try next). Replays log their own rows; use this for everything else."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    return await call_library(ctx, lambda progress, cancel: _task_view(note(root, job, section, text)))


async def task_show_tool(job: JobArg, ctx: Context, workspace: WorkspaceArg = None) -> TaskView:
    """The job's task as data: snapshot, experiments, failed attempts, notes, methods.

    The job's task as data: active snapshot, experiments (id, verdict, grad norm, fidelity, change ...),
    failed attempts, observations, next steps, methods written. The markdown is the resource
    axrl://task/<job>."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    return await call_library(ctx, lambda progress, cancel: _task_view(show_task(root, job)))


async def method_add_tool(
    job: JobArg,
    attempt: Annotated[str, Field(description="Experiment id from the task table, e.g. E4.", min_length=1)],
    name: Annotated[str, Field(description="Method slug, a plain name such as `tis-clip-2`.", min_length=1)],
    rationale: Annotated[str, Field(description="Why it works, from the signals.", min_length=1)],
    ctx: Context,
    allow_reduced: Annotated[
        bool,
        Field(description="Accept a reduced-fidelity attempt (marked diagnostic)."),
    ] = False,
    workspace: WorkspaceArg = None,
) -> MethodAdded:
    """Write a method file from a logged attempt that cleared the spike (refuses unproven or duplicate ones).

    Write spike-mitigation-methods/<name>.md from a logged attempt: job/role, snapshot, key signals (quoted
    from the replay results, the task's diagnosis and an attribution.json of the snapshot in the job's runs;
    nothing is recomputed, what none holds is named as not measured), the config or patch, baseline vs
    mitigated replay, residual spike status, rationale; regenerate the index.
    Refuses attempts that are not cleared/partial, reduced fidelity unless allowed, and duplicates of a
    workspace method (it names the file); a shipped method's change is written as confirms_shipped."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    return await call_library(
        ctx,
        lambda progress, cancel: MethodAdded.model_validate(
            to_jsonable(add_method(root, job, attempt, name, rationale, allow_reduced))
        ),
    )


async def method_list_tool(ctx: Context, workspace: WorkspaceArg = None) -> MethodList:
    """Every method file with its status and summary; check it before method_add.

    Every method file in spike-mitigation-methods/ with its status (proven / partial / diagnostic) and
    one-line summary. Check it before method_add; read one with the resource axrl://method/<slug>."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    return await call_library(
        ctx, lambda progress, cancel: MethodList.model_validate({"methods": to_jsonable(list_methods(root))})
    )


async def write_report_tool(
    job: JobArg,
    ctx: Context,
    release: Annotated[bool, Field(description="Then release the preserved copies of its snapshot.")] = False,
    release_last_copy: Annotated[
        bool,
        Field(description="With release: also a copy that is the last one."),
    ] = False,
    workspace: WorkspaceArg = None,
) -> ReportWritten:
    """Render the investigation's report from the task; at the very end with release=true.

    Render tmp/spike-replay/<job>/report.md from the task: output dir and snapshot, whether full fidelity
    was possible, the baseline grad norm and rel_diff, every attempt with its metrics, the methods added.
    At the very end, call it with release=true to release the preserved copies this investigation uses
    (only its current snapshot's); the last remaining copy of a snapshot is kept unless release_last_copy."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    return await call_library(
        ctx,
        lambda progress, cancel: ReportWritten.model_validate(
            to_jsonable(write_report(root, job, release, release_last_copy=release_last_copy))
        ),
    )


def register(server: MCPServer) -> None:
    """Add the record tools to `server`."""
    server.add_tool(
        task_open_tool,
        name="task_open",
        title="Open the investigation's task file",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False
        ),
    )
    server.add_tool(task_note_tool, name="task_note", title="Add an observation or next step", annotations=WRITES)
    server.add_tool(task_show_tool, name="task_show", title="Read the task file", annotations=READ_ONLY)
    server.add_tool(method_add_tool, name="method_add", title="Write up a proven mitigation", annotations=WRITES)
    server.add_tool(method_list_tool, name="method_list", title="List recorded methods", annotations=READ_ONLY)
    server.add_tool(
        write_report_tool,
        name="write_report",
        title="Write the investigation report",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False
        ),
    )


def _task_view(view: object) -> TaskView:
    """The tool's output for a task view of the library (its JSON, field for field)."""
    return TaskView.model_validate(to_jsonable(view))
