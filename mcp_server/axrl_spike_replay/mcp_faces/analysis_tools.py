"""Tools that read what a snapshot and its logs say (faces over `analysis/`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Annotated, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import Field

from axrl_spike_replay.analysis.batch_signals import BatchAnalysis, analyze_snapshot
from axrl_spike_replay.analysis.grad_info import GradReport, top_param_grads
from axrl_spike_replay.diagnosis.diagnose import Diagnosis
from axrl_spike_replay.diagnosis.evidence.log_scan import LogScan, default_name, scan_logs, with_sampled_series
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How
from axrl_spike_replay.investigation.task_opening import diagnose_into_task
from axrl_spike_replay.logs.series_sampling import DEFAULT_LIMIT
from axrl_spike_replay.mcp_faces.bridge import Progress, call_library, structured
from axrl_spike_replay.mcp_faces.config import TopArg, server_config
from axrl_spike_replay.mcp_faces.shared_arguments import NprocArg, ShardArg, SnapshotArg, WorkspaceArg
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.vocabulary import Shard
from axrl_spike_replay.workspace.paths import TMP_DIR

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)

LogsArg = Annotated[
    list[str],
    Field(
        description="Log files, or dirs holding *.log (e.g. a role output dir).",
        min_length=1,
    ),
]


async def copy_and_scan_logs_tool(
    logs: LogsArg,
    ctx: Context,
    job: Annotated[
        str | None,
        Field(description="Job the copies go under; default: from the paths."),
    ] = None,
    window: Annotated[
        int | None,
        Field(description="Detector window (steps in the median); default: the run's.", ge=1),
    ] = None,
    threshold: Annotated[
        float | None,
        Field(
            description="A spike is a norm over threshold x median; default: the run's.",
            gt=1,
        ),
    ] = None,
    warmup: Annotated[
        int | None,
        Field(description="Steps before the median judges; default: the run's.", ge=0),
    ] = None,
    warmup_ratio: Annotated[
        float | None,
        Field(
            description="In the warm-up, flag a norm this many times the median so far; default: the run's.",
            gt=1,
        ),
    ] = None,
    blind_warmup: Annotated[bool, Field(description="Flag only non-finite norms in the warm-up.")] = False,
    max_norm: Annotated[
        float | None,
        Field(description="Flag any norm above this until the window fills.", gt=0),
    ] = None,
    full_series: Annotated[
        bool,
        Field(description="Every point (default: ~2000, spikes and their neighbours exact)."),
    ] = False,
    plot: Annotated[bool, Field(description="Also return a PNG of the series.")] = True,
    workspace: WorkspaceArg = None,
) -> Annotated[CallToolResult, LogScan]:
    """Copy training logs into the workspace and scan them: grad-norm and loss series, the spikes the detector
    flags, error lines.

    Copy training logs into the workspace (tmp/spike-replay/<job>/logs/) and scan the copies: the
    per-iteration grad-norm and loss series (Megatron `iteration N/ ... grad norm: X |` and key=value lines),
    the spikes the spike guard's detector flags (with the run's own detector settings from its snapshots'
    `run_config.yaml` unless given; armed from step 1 as the guard is, so a spike in the warm-up is flagged too,
    `warm_up: true`), and error lines (tracebacks, NaN/inf, CUDA/NCCL errors).
    Returns a plot of the series with the spikes marked."""
    config = server_config(ctx)
    root = config.workspace_for(workspace)
    paths = [str(config.path(p)) for p in logs]

    def work(progress: Progress, cancel: threading.Event) -> tuple[LogScan, list[bytes]]:
        # a name derived from a directory is as untrusted as one given: both become a path
        if job:
            name = check_plain_name(job, "job name")
        else:
            name = check_plain_name(default_name(paths), "job name derived from the log paths (pass `job`)")
        progress.message(f"copying and scanning {len(paths)} path(s)")
        scan = scan_logs(
            paths,
            root / TMP_DIR / name / "logs",
            window=window,
            threshold=threshold,
            warmup=warmup,
            warmup_ratio="off" if blind_warmup else warmup_ratio,
            max_norm=max_norm,
            progress=progress.message,
            cancel=cancel,
            root=root,
        )
        images = []
        if plot:
            from axrl_spike_replay.analysis.plots import grad_norm_series_png

            progress.message(f"plotting {len(scan.series_points)} points")
            images.append(
                grad_norm_series_png(
                    [(p["iteration"], p["grad_norm"]) for p in scan.series_points],
                    [(s["iteration"], s["grad_norm"]) for s in scan.spikes],
                    title=f"{scan.name}: grad norm per iteration",
                )
            )
        return with_sampled_series(scan, None if full_series else DEFAULT_LIMIT), images

    scan, images = await call_library(ctx, work)
    return structured(LogScan, scan, images)


async def analyze_batch_tool(snapshot: SnapshotArg, ctx: Context, top: TopArg = 10) -> BatchAnalysis:
    """Per-sample and per-token signals of the snapshot's batch across ranks, and its outliers.

    Per-sample and per-token signals of the snapshot's batch across ranks, over loss tokens: advantages
    and their sign balance (negative vs positive magnitude), old/ref/rollout logprobs, the stored old against
    the stored rollout log-probs (`ratio_old_vs_rollout`, `*_log_ratio_old_vs_rollout`: not the replayed policy,
    which attribute_spike and diagnose_spike compare), loss-mask lengths, turn indexes, rewards, routing; summary
    statistics; the top outlier tokens and samples by |log(pi_old/pi_rollout)| and |advantage| with rank, sample,
    position, token id, turn. Field names of verl, slime, OpenRLHF and NeMo-RL batches are understood."""
    config = server_config(ctx)
    return await call_library(ctx, lambda progress, cancel: analyze_snapshot(config.path(snapshot), top=top))


async def top_param_grads_tool(snapshot: SnapshotArg, ctx: Context, top: TopArg = 10) -> GradReport:
    """The largest recorded parameter grad norms, per rank and merged: which layers and ranks carry the spike.

    The largest parameter grad norms recorded at the spike step, per rank (local, before the data-parallel
    reduction) and merged across ranks: which layers (router, one MoE layer's experts, embeddings) and which
    rank carry the spike."""
    config = server_config(ctx)
    return await call_library(ctx, lambda progress, cancel: top_param_grads(config.path(snapshot), top=top))


async def diagnose_spike_tool(
    snapshot: SnapshotArg,
    ctx: Context,
    attribution: Annotated[
        str | None,
        Field(description="An attribution.json from attribute_spike; default: computed here when small."),
    ] = None,
    logs: Annotated[
        list[str] | None,
        Field(description="The job's logs; default: those beside the snapshot."),
    ] = None,
    model: Annotated[
        Literal["auto", "always", "never"],
        Field(description="Compute the model evidence: auto (small checkpoints), always, never."),
    ] = "auto",
    top: TopArg = 10,
    shard: ShardArg = "auto",
    nproc: NprocArg = None,
    detail: Annotated[bool, Field(description="Also return `step`.")] = False,
) -> Diagnosis:
    """Call this first on a spike: likely causes ranked, with ranks, evidence and experiments to run.

    Call this first on a spike: the likely causes ranked by cause family (engine_mismatch,
    stale_old_logprobs, bad_ref_logprobs, routing_payload, outlier_advantage, mask_misalignment,
    negative_advantage_dominance, one_rank_data, non_finite; natural_spike when no broken part is found), each
    naming its ranks, samples and the loss term that carries the gradient, with its evidence as numbers and
    `tied_with` when another family fits as well. With the model (`model` auto on a small checkpoint, or
    always) every stored signal is compared with the replay per rank (`reading.odd`: the odd one out and its
    witnesses) and the gradient is split by loss term (`step.channel`). `next_steps`: ready
    `--mitigation NAME=VALUE` items for replay/sweep, least invasive first, never a no-op for the run's config.
    Also says whether the snapshot agrees with itself and with the training log (`consistency`). With a task
    open for the snapshot's job (`task_open`), the diagnosis is kept there (not by a read-only server): the report
    shows the strongest one run. A read-only server (`mcp --read-only`) runs no replay: it computes no model
    evidence (`model` always, `shard` on or `nproc` are refused) but reads a given `attribution`. The per-rank
    figures behind the causes (`step`, tens of KB) come back with `detail` true only; `reading` summarises them."""
    config = server_config(ctx)
    att = str(config.path(attribution)) if attribution else None
    paths = [str(config.path(p)) for p in logs] if logs else None

    def work(progress: Progress, cancel: threading.Event) -> Diagnosis:
        if config.read_only:
            _refuse_replays_when_read_only(model, shard, nproc)
        result = diagnose_into_task(
            # a read-only server reads: its diagnosis is returned, never written into the task
            None if config.read_only else config.workspace,
            config.path(snapshot),
            attribution=att,
            logs=paths,
            model="never" if config.read_only else model,
            top=top,
            how=How(shard=Shard(shard), nproc=nproc),
        )
        if config.read_only:
            result.not_checked.append(f"model evidence: {_READ_ONLY_RUNS_NO_REPLAY}")
        return result if detail else dataclasses.replace(result, step=None)

    return await call_library(ctx, work)


_READ_ONLY_RUNS_NO_REPLAY = (
    "this server runs read-only (`mcp --read-only`), which runs no replay; pass an `attribution` from "
    "attribute_spike on a server that may"
)


def _refuse_replays_when_read_only(model: str, shard: str, nproc: int | None) -> None:
    """ConfigError for the arguments of `diagnose_spike` that ask for a replay (the model evidence runs one)."""
    asked = [f"`{name}` {value}" for name, value, replays in (
        ("model", model, model == "always"), ("shard", shard, shard in ("on", "streamed")),
        ("nproc", nproc, nproc is not None),
    ) if replays]  # fmt: skip
    if asked:
        raise ConfigError(f"{', '.join(asked)} asks for the model evidence, a replay: {_READ_ONLY_RUNS_NO_REPLAY}")


def register(server: MCPServer) -> None:
    """Add the analysis tools to `server`."""
    server.add_tool(
        copy_and_scan_logs_tool,
        name="copy_and_scan_logs",
        title="Copy a job's logs to tmp/ and scan them",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False
        ),
    )
    server.add_tool(
        analyze_batch_tool,
        name="analyze_batch",
        title="Signals of a snapshot's batch",
        annotations=READ_ONLY,
    )
    server.add_tool(
        top_param_grads_tool, name="top_param_grads", title="Largest parameter grad norms", annotations=READ_ONLY
    )
    server.add_tool(
        diagnose_spike_tool,
        name="diagnose_spike",
        title="Likely causes of a spike",
        annotations=READ_ONLY,
    )
