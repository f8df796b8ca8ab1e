"""Tools that replay a spike step and try mitigations on it (faces over `replay/`). torch is imported only
when one of them runs."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Awaitable
from typing import Annotated, Any, Literal

import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field

from axrl_spike_replay.experiment.mitigations import MITIGATIONS
from axrl_spike_replay.experiment.result import Attribution, ReplayResult, RunResult, SweepResult
from axrl_spike_replay.investigation.request import LOCAL, MAX_REPEAT, How, ReplayRequest, What, Where
from axrl_spike_replay.mcp_faces.bridge import Progress, call_library, structured
from axrl_spike_replay.mcp_faces.config import ServerConfig, SnapshotArg, TopArg, WorkspaceArg, server_config
from axrl_spike_replay.vocabulary import Backend, Device, Method, Shard, Verb

_NAMES = ", ".join(MITIGATIONS)


# Replays write new run dirs and task rows, and may run on a node over SSH (open world). Destructive: with the
# `command` backend they run the node's trainer command, with a `patch` the caller chose: whatever that code does.
REPLAYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=True)

MitigationsArg = Annotated[
    dict[str, Any],
    Field(
        description="One mitigation config {NAME: VALUE}; empty = the baseline replay. Names: "
        f"{_NAMES}. Example: {{'mismatch_token_clip_max': 2, 'routing_replay': 'loss_tokens'}}. "
        "A loss setting scoped to saved ranks, {'aux_loss_coef': '10.24@1'}, is a hypothesis about what those "
        "ranks computed, judged against the recording (`finding`: 'reproduced under ...'). "
        "Values and meaning: resource axrl://mitigations.",
    ),
]
ConfigsArg = Annotated[
    list[dict[str, Any]],
    Field(
        description="Mitigation configs to compare, each {NAME: VALUE, ...} (distinct, none empty: the baseline "
        f"always runs). Names: {_NAMES}. Example: [{{'mismatch_token_clip_max': 2}}, {{'advantage_clip': 1}}].",
        min_length=1,
    ),
]
NprocArg = Annotated[
    int | None,
    Field(
        description="Replay processes; default the saved world size (full fidelity). Fewer gives a reduced-fidelity "
        "diagnostic, labelled as such.",
        ge=1,
    ),
]
DeviceArg = Annotated[Literal["cpu", "cuda"], Field(description="Where the replay processes compute.")]
JobOptArg = Annotated[
    str | None,
    Field(description="Job whose task file logs the attempt; default: the snapshot's job_name."),
]


TargetArg = Annotated[
    str | None,
    Field(
        description="GPU node to run on, as typed: `ssh -p 26461 root@10.100.4.23`, `user@host:port`, "
        "`ssh://user@host:port`, a ~/.ssh/config alias, or a target name from the workspace's spike-replay.yaml. "
        "The snapshot must be at the same path there (shared storage). Omit to run here.",
    ),
]
TargetsArg = Annotated[
    list[str],
    Field(
        description="Several nodes to run one replay on (targets as for `target`): one torchrun agent on each, one "
        "c10d rendezvous on the first, results gathered on rank 0; `nproc` spreads evenly over them. Every node "
        "must see the snapshot at the same path. A `multinode:` entry of spike-replay.yaml named as `target` "
        "does the same.",
    ),
]
SlurmArg = Annotated[
    dict[str, Any] | None,
    Field(
        description="Run as a Slurm job (sbatch, then srun -> torchrun on each allocated node) submitted from "
        "`target` as the login node (omit `target`: this machine). Settings: partition, account, time "
        "(HH:MM:SS), nodes, gpus_per_node, nproc_per_node, cpus_per_task, job_dir, sbatch_args, "
        "schedule_timeout_s; they override those of the `slurm:` entry `target` names. Cancel and `timeout_s` "
        "scancel the job.",
    ),
]
BackendArg = Annotated[
    Literal["torch", "megatron", "command"],
    Field(
        description="torch: the built-in engine; megatron: Megatron-core's own GPTModel recomputes the baseline "
        "of a Megatron snapshot here (replay only, no mitigations; the megatron extra), the cross-check of torch; "
        "command: the node's own replay command from spike-replay.yaml "
        "(trainers the engine cannot rebuild, e.g. TP/PP/EP > 1): mitigations run as the trainer's own overrides "
        "mapped in spike-replay.yaml's command_backend.mitigations (an unmapped one is refused by name), "
        "optionally with `patch`/`patches`.",
    ),
]
PatchArg = Annotated[
    str | None,
    Field(
        description="Unified diff (file path) applied in a temporary git worktree of the node's training checkout "
        "for this run only (backend command); the checkout itself is never modified. The patched code runs on "
        "the node as its SSH user: it can do whatever that user can.",
    ),
]
PatchesArg = Annotated[
    list[str],
    Field(
        description="Several unified diffs (file paths) applied in this order in one temporary git worktree "
        "(backend command), after `patch` when both are given; one that does not apply fails the run by name "
        "and nothing runs.",
    ),
]
RemotePythonArg = Annotated[
    str | None, Field(description="The node's Python interpreter; default: spike-replay.yaml's, else python3.")
]
AcceptNewKeyArg = Annotated[
    bool,
    Field(
        description="Record the host key of a node not yet in known_hosts (like OpenSSH accept-new); only after "
        "the user confirmed the fingerprint. A changed key is always refused."
    ),
]
# No bounds here: the request builder checks the value and names `parallel_configs`, as for the CLI.
ParallelConfigsArg = Annotated[
    int | None,
    Field(
        description="Run the configs on this many pools of `nproc` processes side by side, each also computing the "
        "baseline; the same results as one pool. Default: 1 on CPU, on CUDA as many pools as the GPUs hold. "
        "Built-in torch engine run here only.",
    ),
]
ShardArg = Annotated[
    Literal["auto", "on", "off"],
    Field(
        description="Shard the policy over the replay's processes with FSDP2 (each holds 1/N of the weights and "
        "gradients, loaded straight into its shards): auto = when the whole model does not fit one process; "
        "the same grad norm and verdicts either way.",
    ),
]
TimeoutArg = Annotated[
    float | None, Field(description="Kill the run (its whole process group) after this many seconds.", gt=0)
]


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


ClearThresholdArg = Annotated[
    float | None,
    Field(
        description="Spike ratio (grad norm / median) for verdicts: a mitigation clears the spike under it, the "
        "baseline is a spike at or above it. Default: the snapshot's detector threshold.",
        gt=0,
    ),
]


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
    repeat: Annotated[
        int,
        Field(description="Recompute this many times and report the spread (determinism check).", ge=1, le=MAX_REPEAT),
    ] = 1,
    clear_threshold: ClearThresholdArg = None,
    backend: BackendArg = "torch",
    patch: PatchArg = None,
    patches: PatchesArg = [],  # noqa: B006
    remote_python: RemotePythonArg = None,
    accept_new_host_key: AcceptNewKeyArg = False,
    timeout_s: TimeoutArg = None,
    job: JobOptArg = None,
    workspace: WorkspaceArg = None,
) -> ReplayResult:
    """Recompute the spike step's gradients from the snapshot's weights, batches and routing payloads (no
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
        ),
        How(nproc=nproc, device=Device(device), shard=Shard(shard)),
        workspace=config.workspace_for(workspace),
        job=job,
    )
    result = await _run(ctx, request, config)
    assert isinstance(result, ReplayResult)
    return result


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
    plot: Annotated[bool, Field(description="Also return a PNG bar chart of grad norm per config.")] = True,
    workspace: WorkspaceArg = None,
) -> Annotated[CallToolResult, SweepResult]:
    """Replay the baseline and every config in one run (weights loaded once; loss-level configs share one
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
        What(config.path(snapshot), verb=Verb.SWEEP, configs=tuple(configs), clear_threshold=clear_threshold),
        _where(config, target, backend, patches, remote_python, accept_new_host_key, timeout_s, targets, slurm),
        How(nproc=nproc, device=Device(device), parallel_configs=parallel_configs, shard=Shard(shard)),
        workspace=config.workspace_for(workspace),
        job=job,
    )
    result = await _run(ctx, request, config)
    assert isinstance(result, SweepResult)
    images = [await anyio.to_thread.run_sync(_sweep_png, result)] if plot else []
    return structured(SweepResult, result, images)


async def attribute_spike_tool(
    snapshot: SnapshotArg,
    ctx: Context,
    top: TopArg = 10,
    mitigations: Annotated[
        dict[str, Any],
        Field(description=f"Attribute under a mitigation config instead of the baseline. Names: {_NAMES}."),
    ] = {},  # noqa: B006
    device: DeviceArg = "cpu",
    method: Annotated[
        Literal["jvp", "per_sample_backward"],
        Field(description="jvp (fast, one pass) or per_sample_backward (one backward per sample, a check)."),
    ] = "jvp",
    job: JobOptArg = None,
    workspace: WorkspaceArg = None,
    nproc: NprocArg = None,
    shard: ShardArg = "auto",
) -> Attribution:
    """Each sample's contribution to the global gradient, c_s = <g_s, g> / ||g|| (they sum to ||g||), ranked,
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
        What(target, verb=Verb.ATTRIBUTE, top=top, mitigations=mitigations, method=Method(method)),
        Where(),
        How(nproc=nproc, device=Device(device), shard=Shard(shard)),
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
        title="Replay the spike step (baseline or one mitigation config)",
        annotations=REPLAYS,
    )
    server.add_tool(
        sweep_tool, name="sweep", title="Compare many mitigation configs on one snapshot", annotations=REPLAYS
    )
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
) -> Where:
    """The request's `Where` part for a tool's arguments (patch paths relative to the workspace)."""
    return Where(
        target=target or LOCAL,
        targets=tuple(targets or ()),
        slurm=slurm,
        backend=Backend(backend),
        patches=tuple(str(config.path(p)) for p in patches),
        remote_python=remote_python,
        accept_new_host_key=accept_new_host_key,
        timeout_s=timeout_s,
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
