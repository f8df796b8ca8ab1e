"""Run a request here or on a node: the one place a replay, sweep or attribution picks where it runs.

`torch` on target `local` runs the built-in engine in this process tree; everything else (the torch
engine on an SSH target, the `command` backend) goes to `investigation.elsewhere`. Either way the
run's files land in the workspace and each result is logged in the job's task file when one is open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from axrl_spike_replay.investigation.recording import recorder_for
from axrl_spike_replay.investigation.request import ReplayRequest

if TYPE_CHECKING:
    from axrl_spike_replay.replay.engine import JobRunner


def run_here(request: ReplayRequest, runner: JobRunner | None = None) -> Any:
    """Run a local torch request with the engine (ReplayResult, SweepResult or Attribution by verb).

    `runner` runs replay and sweep jobs (a server's warm pools); default: processes started for this run.
    """
    from dataclasses import replace

    options = replace(request.engine_options(), recorder=recorder_for(request.workspace), runner=runner)
    if request.verb == "attribute":
        from axrl_spike_replay.replay.attribution import attribute_spike

        return attribute_spike(
            request.snapshot,
            request.top,
            mitigations=dict(request.mitigations),
            device=request.device,
            method=request.method,
            recorder=options.recorder,
            job=request.job,
            command=request.command,
            cancel=request.cancel,
        )
    if request.verb == "sweep":
        from axrl_spike_replay.replay.sweep import run_sweep

        return run_sweep(request.snapshot, list(request.configs), options)
    from axrl_spike_replay.replay.engine import run_replay

    return run_replay(request.snapshot, options)


def run_request(request: ReplayRequest) -> Any:
    """Run a request where it says, here or elsewhere; its result (the verb's result type)."""
    from axrl_spike_replay.rank_processes import refuse_in_spawned_import

    refuse_in_spawned_import(f"the {request.verb}")  # before it writes anything: a script without a main guard
    if request.runs_here:
        return run_here(request)
    from axrl_spike_replay.investigation.elsewhere import replay_elsewhere

    return replay_elsewhere(request)
