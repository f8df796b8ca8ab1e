"""Tools that replay a spike step and try mitigations on it (faces over `replay/`). torch is imported only
when one of them runs."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Awaitable
from typing import Annotated, Any

import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field

from axrl_spike_replay.experiment.result import Attribution, ReplayResult, RunResult, SweepResult
from axrl_spike_replay.investigation.request import LOCAL, How, ReplayRequest, What, Where
from axrl_spike_replay.mcp_faces.bridge import Progress, call_library, structured
from axrl_spike_replay.mcp_faces.config import ServerConfig, server_config
from axrl_spike_replay.mcp_faces.shared_arguments import (
    AcceptNewKeyArg,
    BackendArg,
    ClearThresholdArg,
    ConfigsArg,
    DeviceArg,
    JobOptArg,
    MethodArg,
    MitigationsArg,
    NprocArg,
    ParallelConfigsArg,
    PatchArg,
    PatchesArg,
    RemotePythonArg,
    RepeatArg,
    SamplesTopArg,
    ShardArg,
    SlurmArg,
    SnapshotArg,
    TargetArg,
    TargetsArg,
    TimeoutArg,
    WorkspaceArg,
    part_values,
    with_declared_arguments,
)
from axrl_spike_replay.vocabulary import Backend, Device, Method, Shard, Verb

# Replays write new run dirs and task rows, and may run on a node over SSH (open world). Destructive: with the
# `command` backend they run the node's trainer command, with a `patch` the caller chose: whatever that code does.
REPLAYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=True)


async def _run(ctx: Context, request: ReplayRequest, config: ServerConfig, first: str | None = None) -> RunResult:
    """Run the request where it says (`investigation.runs.run_request`, the CLI's function) in a worker thread:
    a local replay uses the server's warm pools; a cancelled call sets the request's cancel event, which stops a
    local run's processes or a remote run's session (and the process group it started)."""
    runner = config.warm.run_job if config.warm is not None else None

    def work(progress: Progress, cancel: threading.Event) -> RunResult:
        from axrl_spike_replay.investigation.runs import run_request

        if first is not None:
            progress.message(first)
        return run_request(dataclasses.replace(request, progress=progress.message, cancel=cancel), runner)

    return await call_library(ctx, work)


def _request(ctx: Context, what: What, where: Where, how: How, **recorded: Any) -> Awaitable[ReplayRequest]:
    """The library's ReplayRequest for a tool's arguments (built in a worker thread: it may read config files)."""

    def build(progress: Progress, cancel: threading.Event) -> ReplayRequest:
        from axrl_spike_replay.investigation.request import replay_request

        return replay_request(what, where, how, **recorded)

    return call_library(ctx, build)


@with_declared_arguments(Verb.REPLAY)
async def replay_tool(
    snapshot: SnapshotArg,
    ctx: Context,
    mitigations: MitigationsArg = {},  # noqa: B006
    target: TargetArg = None,
    targets: TargetsArg = [],  # noqa: B006
    slurm: SlurmArg = None,
    nproc: NprocArg = None,
    device: DeviceArg = "cpu",
    shard: ShardArg = "auto",
    repeat: RepeatArg = 1,
    clear_threshold: ClearThresholdArg = None,
    backend: BackendArg = "torch",
    patch: PatchArg = None,
    patches: PatchesArg = [],  # noqa: B006
    remote_python: RemotePythonArg = None,
    accept_new_host_key: AcceptNewKeyArg = False,
    timeout_s: TimeoutArg = None,
    job: JobOptArg = None,
    workspace: WorkspaceArg = None,
    **declared: Any,
) -> ReplayResult:
    """Recompute the spike step's gradients: the baseline against the recording, or a mitigation config or per-rank
    hypothesis against the baseline; here or on a node.

    Recompute the spike step's gradients from the snapshot's weights, batches and routing payloads (no
    optimizer step), reduce them across data-parallel ranks as the trainer did, and compare the global
    pre-clip grad norm with the recorded one — here, or on a GPU node over SSH (`target`). Without
    mitigations: the baseline (`reproduced` / `not_reproduced`). With a config: a replay-only experiment
    judged against the baseline at the same layout (`cleared` / `partial` / `no_effect` / `worse`, or
    `baseline_not_a_spike` when the baseline is under the threshold). With loss settings scoped to saved ranks
    (`{'aux_loss_coef': '10.24@1'}`): a hypothesis about what those ranks computed, judged against the recording
    as the baseline is, grad norm and every rank's loss (`finding`: "reproduced under `aux_loss_coef=10.24@1`").
    `input_findings`: a rank's routes, tokens, mask or stored log-probs failing a check against the model (rank,
    what fails, how often, the experiments that remove it); the step still replays as the trainer ran it, and where
    no computation is defined on that input the error names it and the experiments to run instead. Writes
    tmp/spike-replay/<job>/<timestamp>/ (command.txt, logs, replay_result.json) and logs the attempt in the
    job's task file. Reports progress; cancelling the call stops a remote run (its process group)."""
    config = server_config(ctx)
    request = await _request(
        ctx,
        What(
            config.path(snapshot),
            verb=Verb.REPLAY,
            mitigations=mitigations,
            repeat=repeat,
            clear_threshold=clear_threshold,
            **part_values(What, declared),
        ),
        _where(
            config,
            target,
            backend,
            [patch, *patches] if patch else patches,
            remote_python,
            accept_new_host_key,
            timeout_s,
            targets,
            slurm,
            declared,
        ),
        How(nproc=nproc, device=Device(device), shard=Shard(shard), **part_values(How, declared)),
        workspace=config.workspace_for(workspace),
        job=job,
    )
    result = await _run(ctx, request, config)
    assert isinstance(result, ReplayResult)
    return result


@with_declared_arguments(Verb.SWEEP)
async def sweep_tool(
    snapshot: SnapshotArg,
    configs: ConfigsArg,
    ctx: Context,
    target: TargetArg = None,
    targets: TargetsArg = [],  # noqa: B006
    slurm: SlurmArg = None,
    nproc: NprocArg = None,
    device: DeviceArg = "cpu",
    parallel_configs: ParallelConfigsArg = None,
    shard: ShardArg = "auto",
    clear_threshold: ClearThresholdArg = None,
    backend: BackendArg = "torch",
    patches: PatchesArg = [],  # noqa: B006
    remote_python: RemotePythonArg = None,
    accept_new_host_key: AcceptNewKeyArg = False,
    timeout_s: TimeoutArg = None,
    job: JobOptArg = None,
    plot: Annotated[bool, Field(description="Also return a PNG bar chart.")] = True,
    workspace: WorkspaceArg = None,
    **declared: Any,
) -> Annotated[CallToolResult, SweepResult]:
    """Replay the baseline and many mitigation configs in one run and compare them (verdict per config, a bar chart).

    Replay the baseline and every config in one run (weights loaded once; loss-level configs share one
    forward pass), here or on a GPU node (`target`, one SSH connection): grad norm, ratio to the median,
    change vs baseline and verdict per config. With `backend` command: the baseline runs once, then each
    config is one run of the node's replay command with its mapped overrides (and `patches`, if any).
    Each config's replay_result.json lands under one tmp/spike-replay/<job>/<timestamp>/ and every config is
    logged in the task file. `parallel_configs` runs the configs on several pools side by side (warm or not),
    with the same results. Returns a bar chart of the grad norms. Reports progress; cancelling the call
    stops a remote run."""
    config = server_config(ctx)
    request = await _request(
        ctx,
        What(
            config.path(snapshot),
            verb=Verb.SWEEP,
            configs=tuple(configs),
            clear_threshold=clear_threshold,
            **part_values(What, declared),
        ),
        _where(
            config, target, backend, patches, remote_python, accept_new_host_key, timeout_s, targets, slurm, declared
        ),
        How(
            nproc=nproc,
            device=Device(device),
            parallel_configs=parallel_configs,
            shard=Shard(shard),
            **part_values(How, declared),
        ),
        workspace=config.workspace_for(workspace),
        job=job,
    )
    result = await _run(ctx, request, config)
    assert isinstance(result, SweepResult)
    images = [await anyio.to_thread.run_sync(_sweep_png, result)] if plot else []
    return structured(SweepResult, result, images)


@with_declared_arguments(Verb.ATTRIBUTE)
async def attribute_spike_tool(
    snapshot: SnapshotArg,
    ctx: Context,
    top: SamplesTopArg = 10,
    mitigations: MitigationsArg = {},  # noqa: B006
    device: DeviceArg = "cpu",
    method: MethodArg = "jvp",
    job: JobOptArg = None,
    workspace: WorkspaceArg = None,
    nproc: NprocArg = None,
    shard: ShardArg = "auto",
    **declared: Any,
) -> Attribution:
    """Each sample's contribution to the spike's gradient, ranked, with its signals: which few samples carry it.

    Each sample's contribution to the global gradient, c_s = <g_s, g> / ||g|| (they sum to ||g||), ranked,
    with the sample's signals (advantage, reward, loss tokens, rank, and max_abs_log_ratio_current_vs_base: the
    largest |log pi - log pi_base| of the replayed policy against `log_ratio_base`, the old or rollout log-probs
    its loss's ratio is taken against). Usually a few samples carry the spike; cross-check them with
    analyze_batch's outliers (old against rollout). A model that does not fit one process is attributed sharded
    over `nproc` processes (one backward per sample; `method` does not apply). Writes attribution.json under
    tmp/spike-replay/<job>/<timestamp>/."""
    config = server_config(ctx)
    target = config.path(snapshot)
    request = await _request(
        ctx,
        What(
            target,
            verb=Verb.ATTRIBUTE,
            top=top,
            mitigations=mitigations,
            method=Method(method),
            **part_values(What, declared),
        ),
        Where(**part_values(Where, declared)),
        How(nproc=nproc, device=Device(device), shard=Shard(shard), **part_values(How, declared)),
        workspace=config.workspace_for(workspace),
        job=job,
    )
    result = await _run(ctx, request, config, f"attributing the spike of {target} to its samples ({method})")
    assert isinstance(result, Attribution)
    return result


def register(server: MCPServer) -> None:
    """Add the replay tools to `server`."""
    server.add_tool(
        replay_tool,
        name="replay",
        title="Replay the spike step",
        annotations=REPLAYS,
    )
    server.add_tool(sweep_tool, name="sweep", title="Compare mitigation configs", annotations=REPLAYS)
    server.add_tool(
        attribute_spike_tool,
        name="attribute_spike",
        title="Which samples carry the spike",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
        ),
    )


def _where(
    config: ServerConfig,
    target: str | None,
    backend: str,
    patches: list[str],
    remote_python: str | None,
    accept_new_host_key: bool,
    timeout_s: float | None,
    targets: list[str] | None = None,
    slurm: dict[str, Any] | None = None,
    declared: dict[str, Any] | None = None,
) -> Where:
    """The request's `Where` part for a tool's arguments (patch paths relative to the workspace; `declared`: the
    generated arguments)."""
    return Where(
        target=target or LOCAL,
        targets=tuple(targets or ()),
        slurm=slurm,
        backend=Backend(backend),
        patches=tuple(str(config.path(p)) for p in patches),
        remote_python=remote_python,
        accept_new_host_key=accept_new_host_key,
        timeout_s=timeout_s,
        **part_values(Where, declared or {}),
    )


def _sweep_png(sweep: SweepResult) -> bytes:
    from axrl_spike_replay.analysis.plots import sweep_png

    rows = [sweep.baseline, *sweep.results]
    return sweep_png(
        [r.config_id for r in rows],
        [r.grad_norm for r in rows],
        [r.verdict for r in rows],
        baseline=sweep.baseline.grad_norm,
        recorded=sweep.baseline.recorded_grad_norm,
        median=sweep.baseline.median_norm,
        threshold=sweep.threshold,
        title=f"{sweep.baseline.job_name or 'sweep'} iter {sweep.baseline.iteration}: grad norm per config "
        f"({sweep.fidelity} fidelity)",
    )
