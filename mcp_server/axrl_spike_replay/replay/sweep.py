"""Sweep: many mitigation configs on one snapshot in one run, weights loaded once.

Every process loads the snapshot's weights once and forwards each rank batch once for all the
configs that change only the loss (each config backpropagates its own loss from the shared
graph); configs that change routing or weights get their own forward. The baseline runs in the
same job, so every config is judged against the baseline at the same layout. With several pools
(`parallel_configs`, or one per group of GPUs on CUDA) the configs are spread over them, each pool
computing the baseline too: the same results as one pool, in the configs' order.
"""

from __future__ import annotations

from axrl_spike_replay.experiment.request.request_parts import ReplayRequest
from axrl_spike_replay.experiment.result import SweepResult
from axrl_spike_replay.experiment.run_dir import SWEEP_FILE, RunRecorder
from axrl_spike_replay.replay.engine import replay_session
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.replay.plans.replay_plan import HERE, Capacity
from axrl_spike_replay.replay.streamed.settings import StreamSettings


def run_sweep(
    request: ReplayRequest,
    *,
    recorder: RunRecorder | None = None,
    runner: JobRunner | None = None,
    capacity: Capacity | str | None = HERE,
    nodes: int = 1,
    checkpoint: bool | None = None,
    stream: StreamSettings | None = None,
) -> SweepResult:
    """Replay the baseline and every config of the request's `what.configs` in one job; results in the configs'
    order (the keyword arguments as for `engine.run_replay`).

    Output (with a recorder): `<ts>/baseline/replay_result.json`, `<ts>/<config_id>/replay_result.json`
    for each config and `<ts>/sweep_result.json`; each is logged in the job's task file when one is open.
    """
    from axrl_spike_replay.replay.jobs.job_runner import configs_in_parallel, run_job

    pools = request.how.parallel_configs
    if pools != 1:  # independent configs side by side on several pools (configs_in_parallel)
        runner = configs_in_parallel(runner or run_job, pools)
    configs = list(request.what.configs)  # normalised and distinct: the request checked them
    with replay_session(
        request,
        configs,
        "sweep",
        recorder=recorder,
        runner=runner,
        capacity=capacity,
        nodes=nodes,
        checkpoint=checkpoint,
        stream=stream,
    ) as session:
        baseline, results = session.execute()
        sweep = SweepResult(
            snapshot=str(request.what.snapshot),
            fidelity=session.plan.fidelity,
            world_size_saved=session.inputs.world_size,
            world_size_used=session.plan.nproc,
            device=str(request.how.device),
            threshold=session.threshold,
            baseline=baseline,
            results=results,
            output_dir=str(session.run.path or ""),
        )
        paths = [session.run.write_result(result, result.config_id) for result in (baseline, *results)]
        sweep.timings = {"total": baseline.timings.get("total", 0.0), "load": baseline.timings.get("load", 0.0)}
        session.run.write_json(SWEEP_FILE, sweep.to_json())
    for result, path in zip((baseline, *results), paths, strict=True):
        session.record(result, path)  # after every file is complete
    return sweep
