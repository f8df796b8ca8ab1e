"""Requests that do not run in this process tree: the torch backend on an SSH target, and the command backend.

`investigation.runs` sends every replay or sweep that is not `torch` on `local` here. One SSH
connection serves the whole run (probe, upload, command, result download, clean-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.result import ReplayResult, SweepResult
from axrl_spike_replay.experiment.run_dir import SWEEP_FILE, RunDir, write_and_record
from axrl_spike_replay.investigation.recording import WorkspaceRecorder
from axrl_spike_replay.investigation.request import LOCAL, ReplayRequest
from axrl_spike_replay.remote.command.command_backend import CommandRequest, run_command_backend, run_command_sweep
from axrl_spike_replay.remote.command.command_overrides import check_concrete, check_mapped
from axrl_spike_replay.remote.nodes.node_probe import probe
from axrl_spike_replay.remote.nodes.results import snapshot_facts
from axrl_spike_replay.remote.remote_replay import RemoteReplayRequest, plan_processes, run_remote_torch
from axrl_spike_replay.remote.transport.cancellable import cancellable
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.connect import connect_settings
from axrl_spike_replay.remote.transport.job import LineCallback, Session
from axrl_spike_replay.remote.transport.local_session import LocalSession
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.transport.session import RemoteSession, open_session
from axrl_spike_replay.remote.transport.target_config import ResolvedTarget
from axrl_spike_replay.remote.workspace_config import CONFIG_FILE, load_workspace_config, resolve_target
from axrl_spike_replay.vocabulary import Backend, Verb, Verdict

T = TypeVar("T")


async def replay_elsewhere_async(request: ReplayRequest) -> ReplayResult | SweepResult:
    """Run a replay or a sweep on an SSH target and/or with the command backend; results written locally."""
    if request.runs_here:
        raise ConfigError("the torch backend on target 'local' runs in this process tree (investigation.runs)")
    what, where, how = request.what, request.where, request.how
    remote, verb = remote_options(request), what.verb
    facts = snapshot_facts(what.snapshot)
    workspace = request.workspace if request.workspace is not None else Path(".")
    config = load_workspace_config(workspace)
    mitigations = dict(what.mitigations)
    normalised = [dict(c) for c in what.configs]
    if where.backend == Backend.COMMAND:
        if config.command_backend is None:
            raise ConfigError(
                f"`backend` command needs a command_backend section in {workspace / 'spike-replay.yaml'} "
                "(workdir, command with {snapshot} and {out})",
                "backend",
            )
        # every mitigation must map onto the trainer's own override, refused by name before anything runs
        check_mapped(config.command_backend.mitigations, [mitigations, *normalised], str(workspace / CONFIG_FILE))
        check_concrete([mitigations, *normalised])
    resolved = None if where.target == LOCAL else resolve_target(where.target, config, remote.remote_python)
    job = request.job or facts.job
    async with _session(resolved, remote) as session:
        torch_here = where.backend == Backend.TORCH
        node = None
        if resolved is not None:  # one round trip: host, GPUs and (torch backend) the node's temp workspace
            node = await probe(session, with_python=False, temp_prefix="axrl-ws-" if torch_here else None)
        nproc = how.nproc
        if torch_here and node is not None:
            try:
                nproc = plan_processes(how.device, how.nproc, facts.world_size, node)
            except ConfigError:
                if node.temp_dir:
                    await session.remove_temp_dir(node.temp_dir)
                raise
        recorder = WorkspaceRecorder(workspace, target=session.label, progress=request.progress)  # as here
        run = recorder.open_run(job)
        on_line = _echo(request, session.label)
        if where.backend == Backend.COMMAND:
            if config.command_backend is None:  # the request's validation already says so; this narrows the type
                raise ConfigError("`backend` command needs a command_backend section in spike-replay.yaml", "backend")
            command_request = CommandRequest(
                facts=facts,
                backend=config.command_backend,
                what=what,
                patches=remote.patches,
                timeout_s=remote.timeout_s,
                setup=resolved.setup if resolved else (),
                target=session.label,
                node=node.node_field() if node else None,
            )
            result: ReplayResult | SweepResult
            if verb == Verb.SWEEP:
                result = await run_command_sweep(
                    session,
                    command_request,
                    normalised,
                    run,
                    recorder=recorder,
                    on_line=on_line,
                    progress=request.progress,
                )
            else:
                result = await run_command_backend(
                    session, command_request, run, recorder=recorder, on_line=on_line, progress=request.progress
                )
        else:
            assert isinstance(session, RemoteSession) and resolved is not None and node is not None
            request_t = RemoteReplayRequest(
                facts=facts,
                python=resolved.python,
                what=what,
                how=replace(how, nproc=nproc),
                job=job,
                setup=resolved.setup,
                timeout_s=remote.timeout_s,
                target=session.label,
            )
            result = await run_remote_torch(
                session, request_t, run, node, recorder=recorder, on_line=on_line, progress=request.progress
            )
    if isinstance(result, SweepResult) and what.refused:
        result = _with_refused(result, what.refused, run, recorder, job)
    failed = result.baseline if isinstance(result, SweepResult) and result.baseline.verdict == "failed" else result
    if isinstance(failed, ReplayResult) and failed.verdict == "failed":
        raise AxrlError(f"{verb} failed: {failed.error} (see {run.path})")
    return result


def _with_refused(
    sweep: SweepResult,
    refused: Sequence[tuple[int, Mapping[str, Any], str]],
    run: RunDir,
    recorder: WorkspaceRecorder,
    job: str,
) -> SweepResult:
    """The sweep with each config its request refused put in its place among the results (verdict failed, why),
    written beside the others and logged under Failed attempts, as the engine reports its own refusals."""
    from axrl_spike_replay.experiment.mitigation.mitigations import config_id, normal_form

    base, results = sweep.baseline, list(sweep.results)
    for place, config, why in sorted(refused, key=lambda r: r[0]):
        shown = normal_form(config)
        failed = replace(
            base,
            mitigations=shown,
            config_id=config_id(shown),
            grad_norm=None,
            rel_diff=None,
            spike_ratio=None,
            verdict=Verdict.FAILED,
            error=f"refused: {why}",
            **_EMPTY,
        )
        write_and_record(run, failed, recorder, job, failed.config_id)
        results.insert(place, failed)
    out = replace(sweep, results=results)
    run.write_json(SWEEP_FILE, out.to_json())
    return out


# what a refused config's result leaves empty that a baseline's result holds
_EMPTY: dict[str, Any] = {
    "top_params": [],
    "timings": {},
    "repeat_grad_norms": [],
    "repeat_spread": None,
    "rank_metrics": [],
    "consistency": None,
    "verdict_basis": None,
    "tolerance": None,
    "output_dir": "",
    "footprint": None,
    "cosine_to_clean": None,
    "clean_gradient": None,
    "hypothesis": {},
    "finding": None,
}


def replay_elsewhere(request: ReplayRequest) -> ReplayResult | SweepResult:
    """Synchronous `replay_elsewhere_async`. Ctrl-C, or setting `request.cancel`, stops the run: the remote
    process group is killed and the failed result (with the partial logs) is written."""
    return asyncio.run(_cancellable(replay_elsewhere_async(request), request.cancel))


def remote_options(request: ReplayRequest) -> RemoteOptions:
    """The connection and external-command settings of a run on a node or with the command backend."""
    where = request.where
    return RemoteOptions(
        remote_python=where.remote_python,
        known_hosts=where.known_hosts,
        accept_new_host_key=where.accept_new_host_key,
        timeout_s=where.timeout_s,
        patches=where.patches,
        cancel=request.cancel,
    )


async def _cancellable(work: Awaitable[T], cancel: threading.Event | None) -> T:
    """Await `work`, cancelling it when `cancel` gets set (a cancelled MCP call sets it from another thread)."""
    return await cancellable(work, cancel, AxrlError("cancelled: the run was stopped and its partial output kept"))


@contextlib.asynccontextmanager
async def _session(resolved: ResolvedTarget | None, remote: RemoteOptions) -> AsyncIterator[Session]:
    if resolved is None:
        yield LocalSession()
        return
    session = await open_session(
        resolved.ssh, connect_settings(remote.known_hosts or resolved.known_hosts, remote.accept_new_host_key)
    )
    session.label = resolved.label
    try:
        yield session
    finally:
        await run_to_completion(session.close())


def _echo(request: ReplayRequest, label: str) -> LineCallback | None:
    """Mirror the run's stderr (and a command's stdout) as progress lines, tagged with the target."""
    if request.progress is None:
        return None
    progress = request.progress
    command = request.where.backend == Backend.COMMAND

    def echo(stream: str, line: str) -> None:
        if stream == "stderr" or command:
            progress(f"[{label}] {line}")

    return echo
