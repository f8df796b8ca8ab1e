"""Replays whose processes torchrun starts elsewhere: on several SSH nodes (one agent each, one rendezvous), or
under `srun` in a Slurm allocation. The engine runs here, as for a local replay (the snapshot is read here and on
every node at the same path: shared storage); only where its processes run differs (`remote.launchers.replay_launch`).

The run dir, its results and the task-file rows are the one recorder's (`investigation.recording`), as for any
run; each result names the placement as its `target` and records, as its `node`, the launcher, the nodes and
which host ran which process. The launcher's own files (command lines, requests, every node's log) are kept
under the run dir's `launch/`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from axrl_spike_replay.experiment.result import ReplayResult, SweepResult
from axrl_spike_replay.experiment.run_dir import RunDir, command_line
from axrl_spike_replay.investigation.placement import placement_for
from axrl_spike_replay.investigation.recording import WorkspaceRecorder
from axrl_spike_replay.investigation.request import LOCAL, ReplayRequest
from axrl_spike_replay.remote.launchers.replay_launch import LaunchedRunner, Placement
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.workspace_config import load_workspace_config
from axrl_spike_replay.vocabulary import Device, Verb


class _StampedRunDir(RunDir):
    """The run dir of a launched replay: each result written names the placement and the launch."""

    def __init__(self, path: Path | None, runner: LaunchedRunner) -> None:
        super().__init__(path)
        self.runner = runner

    def write_result(self, result: ReplayResult, sub: str | None = None) -> Path | None:
        result.target = self.runner.placement.name
        result.node = launch_record(self.runner)
        return super().write_result(result, sub)


class LaunchRecorder:
    """The workspace recorder for a launched replay: the one recorder, its run dir stamping the launch."""

    def __init__(self, workspace: Path, runner: LaunchedRunner, progress: Callable[[str], None] | None = None) -> None:
        self.inner = WorkspaceRecorder(workspace, target=runner.placement.name, progress=progress)
        self.runner = runner
        self.run: RunDir | None = None

    def open_run(self, job: str) -> RunDir:
        self.run = _StampedRunDir(self.inner.open_run(job).path, self.runner)
        return self.run

    def replayed(self, job: str, result: ReplayResult, path: Path) -> str | None:
        return self.inner.replayed(job, result, path)

    def failed(self, job: str, *, reason: str, command: str, snapshot: str, result_path: Path | None) -> str | None:
        return self.inner.failed(job, reason=reason, command=command, snapshot=snapshot, result_path=result_path)


def launch_record(runner: LaunchedRunner) -> dict[str, Any]:
    """The `node` field of a launched replay's results: launcher, nodes, job id or rendezvous, who ran what."""
    placement, last = runner.placement, runner.last
    doc: dict[str, Any] = {
        "launcher": placement.launcher,
        "placement": placement.describe(),
        "nodes": list(last.nodes) if last is not None else [n.name for n in placement.nodes],
        "processes_per_node": placement.per_node,
    }
    if last is not None:
        doc.update(
            launch_id=last.launch_id,
            seconds=last.seconds,
            start_s=last.start_s,
            processes=last.result.get("processes", []),
        )
        if last.rendezvous:
            doc["rendezvous"] = last.rendezvous
        if last.job_id:
            doc["slurm_job_id"] = last.job_id
    return doc


def replay_launched(request: ReplayRequest) -> ReplayResult | SweepResult:
    """Run a replay or sweep with its processes launched on several nodes or under Slurm; results recorded here."""
    from axrl_spike_replay.remote.nodes.results import snapshot_facts

    what, where, how = request.what, request.where, request.how
    workspace = request.workspace if request.workspace is not None else Path(".")
    config = load_workspace_config(workspace)
    facts = snapshot_facts(what.snapshot)
    placement = placement_for(request, config, facts.world_size)
    options = RemoteOptions(
        remote_python=where.remote_python,
        known_hosts=where.known_hosts,
        accept_new_host_key=where.accept_new_host_key,
        timeout_s=where.timeout_s,
    )
    runner = LaunchedRunner(
        placement,
        options=options,
        backend="nccl" if how.device == Device.CUDA else "gloo",
        timeout_s=where.timeout_s,
    )
    first = placement.nodes[0].target if placement.nodes else None
    capacity = None  # a node's memory, where it is probed: what `shard: auto` plans against
    if how.device == Device.CUDA and first is not None:  # a Slurm allocation's GPUs are known once it runs
        from axrl_spike_replay.investigation.planning import refuse_on_nodes

        configs = 1 + (len(what.configs) if what.verb == Verb.SWEEP else int(bool(what.mitigations)))
        capacity = refuse_on_nodes(
            what.snapshot,
            first,
            nproc=placement.processes,
            nodes=placement.node_count,
            configs=configs,
            options=options,
            progress=request.progress,
            shard=str(how.shard),
        )
    recorder = LaunchRecorder(workspace, runner, request.progress) if request.workspace is not None else None
    if recorder is not None:
        runner.out_dir = lambda: recorder.run.path if recorder.run is not None else None
    # the request as asked, over the launched processes; `auto` plans against the probed node's GPUs, never this
    # machine's memory; where no node was probed (CPU, Slurm) the capacity is unknown and the whole model stays. `on`
    # shards over every launched process
    engine = replace(
        request,
        how=replace(how, nproc=placement.processes),
        command=request.command or _command(request, placement),
    )
    nodes = placement.node_count
    if what.verb == Verb.SWEEP:
        from axrl_spike_replay.replay.sweep import run_sweep

        return run_sweep(engine, recorder=recorder, runner=runner, capacity=capacity, nodes=nodes)
    from axrl_spike_replay.replay.engine import run_replay

    return run_replay(engine, recorder=recorder, runner=runner, capacity=capacity, nodes=nodes)


def _command(request: ReplayRequest, placement: Placement) -> str:
    """The equivalent CLI command, placement included, for command.txt."""
    from axrl_spike_replay.experiment.mitigation.mitigations import mitigation_args

    what, where = request.what, request.where
    options: dict[str, Any] = {"nproc": placement.processes, "device": str(request.how.device)}
    if where.targets:
        options["target"] = list(where.targets)
    elif where.target != LOCAL:
        options["target"] = where.target
    if where.slurm is not None:
        options["slurm"] = True
    for key, value in (where.slurm or {}).items():
        options[key] = list(value) if isinstance(value, tuple) else value
    if what.verb == Verb.REPLAY:
        options["mitigation"] = mitigation_args(what.mitigations)
    else:
        options["mitigation"] = [shlex.join(mitigation_args(c)) for c in what.configs]
    options["clear_threshold"] = what.clear_threshold
    options["timeout"] = where.timeout_s
    return command_line(str(what.verb), str(what.snapshot), options)
