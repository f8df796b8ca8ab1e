"""Run a request where it says: the one place a replay, sweep or attribution picks here or elsewhere.

`torch` (and `megatron`, route 2 of a Megatron snapshot) on target `local` runs the built-in engine in this
process tree; on several nodes or under Slurm the engine runs here and torchrun starts its processes there
(`investigation.launched`); everything else (the torch engine on one SSH target, the `command` backend) goes to
`investigation.elsewhere`. Either way the
run's files land in the workspace and each result is logged in the job's task file when one is open.
The CLI, the MCP tools, the CLI's warm service and the demo all call `run_request`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from axrl_spike_replay.experiment.result import RunResult
from axrl_spike_replay.investigation.recording import recorder_for
from axrl_spike_replay.investigation.request import ReplayRequest, launched
from axrl_spike_replay.vocabulary import Shard, Verb

if TYPE_CHECKING:  # torch-free at import: the faces import this before anything runs
    from axrl_spike_replay.replay.jobs.job_runner import JobRunner


def run_request(request: ReplayRequest, runner: JobRunner | None = None) -> RunResult:
    """Run `request` here or elsewhere; its result (ReplayResult, SweepResult or Attribution, by its verb).

    `runner` runs a local replay's or sweep's jobs (a server's warm pools); default: processes started for
    this run. A run elsewhere stops when `request.cancel` is set, as a local one does."""
    from axrl_spike_replay.processes.rank_processes import refuse_in_spawned_import

    refuse_in_spawned_import(f"the {request.what.verb}")  # before it writes anything: a script without a main guard
    if not request.runs_here:
        if launched(request):  # several nodes or Slurm: the engine here, its processes started by torchrun there
            from axrl_spike_replay.investigation.launched import replay_launched

            return replay_launched(request)
        from axrl_spike_replay.investigation.elsewhere import replay_elsewhere

        return replay_elsewhere(request)
    return _run_here(request, runner)


def _run_here(request: ReplayRequest, runner: JobRunner | None) -> RunResult:
    """The engine in this process tree."""
    what, how = request.what, request.how
    # an unsharded attribution holds the whole model in one process; sharded (on, or auto when the whole model does
    # not fit one), it lays its processes out as a replay does, and the plan refuses only what fits neither way
    whole = what.verb == Verb.ATTRIBUTE and how.shard == Shard.OFF
    if runner is None and not whole and _starts_processes(request):
        from axrl_spike_replay.processes.process_starts import warm_up

        # before this process imports torch: the server imports it (and the model's libraries) meanwhile
        warm_up(_model_kinds(request))
    from axrl_spike_replay.investigation.planning import refuse_what_cannot_fit

    nproc = 1 if whole else how.nproc
    configs = 1 + (len(what.configs) if what.verb == Verb.SWEEP else int(bool(what.mitigations)))
    refuse_what_cannot_fit(what.snapshot, nproc, str(how.device), configs, str(how.shard))
    recorder = recorder_for(request.workspace, request.progress)
    if what.verb == Verb.ATTRIBUTE:
        from axrl_spike_replay.replay.analyses.attribution import attribute_spike

        return attribute_spike(request, recorder=recorder)
    if what.verb == Verb.SWEEP:
        from axrl_spike_replay.replay.sweep import run_sweep

        return run_sweep(request, recorder=recorder, runner=runner)
    from axrl_spike_replay.replay.engine import run_replay

    return run_replay(request, recorder=recorder, runner=runner)


def _starts_processes(request: ReplayRequest) -> bool:
    """Whether a run here will start rank processes: more than one, or a sharded group (of one too). Without
    `nproc`, the snapshot's saved data ranks (its metadata, read cheaply); a snapshot that cannot be read: no."""
    how = request.how
    if how.shard == Shard.ON:
        return True
    if how.shard == Shard.STREAMED:
        return False
    if how.nproc is not None:
        return how.nproc > 1
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.snapshot.metadata import read_metadata

    try:
        return read_metadata(request.what.snapshot)[0].parallel.data_ranks > 1
    except (AxrlError, OSError, ValueError):
        return False  # the engine names what is wrong with it


def _model_kinds(request: ReplayRequest) -> tuple[str, ...]:
    """The snapshot's model kind (`model.kind` in its run config, read without torch), for the process server to
    import that kind's libraries before its ranks fork; none when it cannot be read (the engine names why)."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.snapshot.layout import RUN_CONFIG
    from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

    snapshot = request.what.snapshot
    try:
        doc = read_untrusted_yaml(snapshot / RUN_CONFIG, "run config", within=snapshot)
    except (AxrlError, OSError, ValueError):
        return ()
    model = doc.get("model") if isinstance(doc, dict) else None
    kind = model.get("kind") if isinstance(model, dict) else None
    return (kind,) if isinstance(kind, str) else ()
