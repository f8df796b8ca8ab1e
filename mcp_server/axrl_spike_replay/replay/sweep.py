"""Sweep: many mitigation configs on one snapshot in one run, weights loaded once.

Every process loads the snapshot's weights once and forwards each rank batch once for all the
configs that change only the loss (each config backpropagates its own loss from the shared
graph); configs that change routing or weights get their own forward. The baseline runs in the
same job, so every config is judged against the baseline at the same layout. With several pools
(`parallel_configs`, or one per group of GPUs on CUDA) the configs are spread over them, each pool
computing the baseline too: the same results as one pool, in the configs' order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from axrl_spike_replay.experiment.mitigation.mitigations import check_distinct, parse_config
from axrl_spike_replay.experiment.result import SweepResult
from axrl_spike_replay.experiment.run_dir import SWEEP_FILE
from axrl_spike_replay.replay.engine import ReplayOptions, replay_session


def run_sweep(
    snapshot: str | Path, configs: Sequence[Mapping[str, Any]], options: ReplayOptions | None = None
) -> SweepResult:
    """Replay the baseline and every config of `configs` in one job; results in the configs' order.

    Output (with a workspace): `<ts>/baseline/replay_result.json`, `<ts>/<config_id>/replay_result.json`
    for each config and `<ts>/sweep_result.json`; each is logged in the job's task file when one is open.
    """
    from dataclasses import replace

    from axrl_spike_replay.replay.jobs.job_runner import configs_in_parallel, run_job

    options = options or ReplayOptions()
    if options.parallel_configs != 1:  # independent configs side by side on several pools (configs_in_parallel)
        options = replace(options, runner=configs_in_parallel(options.runner or run_job, options.parallel_configs))
    normalised = [parse_config(c, f"config {i + 1}") for i, c in enumerate(configs)]
    check_distinct(normalised)
    with replay_session(snapshot, options, normalised, "sweep") as session:
        baseline, results = session.execute()
        sweep = SweepResult(
            snapshot=str(snapshot),
            fidelity=session.plan.fidelity,
            world_size_saved=session.inputs.world_size,
            world_size_used=session.plan.nproc,
            device=options.device,
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
