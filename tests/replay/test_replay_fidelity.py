"""Reproducing a captured spike: full and reduced fidelity, bit-identical baselines, legacy snapshots, outputs.

Bit-identity holds for a snapshot captured on this machine (a fresh capture, made once per session).
The golden fixtures were recorded on another machine, whose CPU kernels may round the last bits
differently: against them a replay is held to the documented tolerance (1e-6 full, 1e-5 reduced).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.replay.sweep import run_sweep
from axrl_spike_replay.vocabulary import Verb
from axrl_spike_replay.workspace.task_record.task_state import show_task


@pytest.fixture(scope="module")
def full_replay(
    spike_snapshot: Path, tmp_path_factory: pytest.TempPathFactory, warm_runner: JobRunner
) -> tuple[ReplayResult, Path]:
    """The spike replayed at its saved world size (two gloo processes), twice for the determinism check."""
    ws = tmp_path_factory.mktemp("full-ws")
    request = replay_request(What(spike_snapshot, repeat=2), how=How(nproc=2), workspace=ws)
    return run_request(request, warm_runner), ws


def test_full_fidelity_reproduces_the_recorded_grad_norm(full_replay: tuple[ReplayResult, Path]) -> None:
    result, _ = full_replay
    assert result.fidelity == "full"
    assert (result.world_size_saved, result.world_size_used) == (2, 2)
    assert result.rel_diff is not None and result.rel_diff <= 1e-6
    assert result.verdict == "reproduced" and result.tolerance == 1e-6
    assert result.spike_ratio > result.threshold  # the replay shows the spike the detector saw
    norms = [p.grad_norm for p in result.top_params if p.grad_norm is not None]
    assert norms and len(norms) == len(result.top_params) and norms[0] >= norms[-1]
    assert [m["rank"] for m in result.rank_metrics] == [0, 1]


def test_no_mitigation_replay_is_bit_identical_to_training(captured_run, warm_runner: JobRunner) -> None:
    worst = captured_run.snapshot_dirs[captured_run.spike_ratios.index(max(captured_run.spike_ratios))]
    # captured here, replayed here, at the saved world size
    result = run_replay(replay_request(What(worst), how=How(nproc=2)), runner=warm_runner)
    assert result.fidelity == "full"
    assert result.grad_norm == result.recorded_grad_norm
    assert result.rel_diff == 0.0


def test_repeat_reports_a_zero_spread(full_replay: tuple[ReplayResult, Path]) -> None:
    result, _ = full_replay
    assert len(result.repeat_grad_norms) == 2
    assert result.repeat_spread == 0.0


def test_outputs_land_in_the_workspace_tmp_dir(full_replay: tuple[ReplayResult, Path]) -> None:
    result, ws = full_replay
    out = Path(result.output_dir)
    assert out.parent == ws / "tmp" / "spike-replay" / "fixture-moe"
    assert "axrl-spike-replay replay" in (out / "command.txt").read_text(encoding="utf-8")
    assert "reproduced" in (out / "replay.log").read_text(encoding="utf-8")
    doc = json.loads((out / "replay_result.json").read_text(encoding="utf-8"))
    assert ReplayResult.from_json(doc) == result
    for key in ("fidelity", "world_size_saved", "world_size_used", "mitigations", "grad_norm", "recorded_grad_norm"):
        assert key in doc
    assert {"load", "compute", "total"} <= set(doc["timings"])


def test_one_process_replaying_both_saved_ranks_is_full_fidelity(spike_snapshot: Path) -> None:
    """Every saved rank replayed (in turn, by one process): the same data-parallel mean, full fidelity, held to the
    looser tolerance of its summation order (1e-5)."""
    result = run_replay(replay_request(What(spike_snapshot), how=How(nproc=1)))
    assert result.fidelity == "full"
    assert (result.world_size_saved, result.world_size_used) == (2, 1)
    assert result.rel_diff is not None and result.rel_diff <= 1e-5
    assert result.verdict == "reproduced" and result.tolerance == 1e-5
    assert result.output_dir == ""  # no workspace: nothing written


def test_every_way_of_running_the_baseline_gives_the_same_bits(spike_snapshot: Path) -> None:
    replay = run_replay(replay_request(What(spike_snapshot), how=How(nproc=1)))
    sweep = run_sweep(
        replay_request(
            What(spike_snapshot, verb=Verb.SWEEP, configs=tuple([{"clip_eps_low": 0.2, "clip_eps_high": 0.2}])),
            how=How(nproc=1),
        )
    )
    assert sweep.baseline.grad_norm == replay.grad_norm
    restated = sweep.results[0]  # the saved values, restated as a "mitigation"
    assert restated.grad_norm == replay.grad_norm
    assert restated.verdict == "no_effect" and restated.change_vs_baseline == 0.0


def test_legacy_snapshot_replays_without_being_touched(legacy_snapshot: Path) -> None:
    before = {p.name: p.read_bytes() for p in legacy_snapshot.iterdir()}
    result = run_replay(replay_request(What(legacy_snapshot), how=How(nproc=1)))
    assert result.legacy_layout is True
    assert result.verdict == "reproduced" and result.rel_diff <= 1e-5
    assert {p.name: p.read_bytes() for p in legacy_snapshot.iterdir()} == before


def test_a_replay_is_logged_in_the_open_task(spike_snapshot: Path, workspace: Path) -> None:
    open_task(workspace, "fixture-moe", spike_snapshot)
    result = run_request(
        replay_request(
            What(spike_snapshot, mitigations={"mismatch_token_clip_max": 2}),
            how=How(nproc=1),
            workspace=workspace,
        )
    )
    assert result.verdict == "cleared"
    # a reduced baseline of a golden fixture: within the reduced tolerance, not bit for bit
    assert result.baseline_grad_norm == pytest.approx(result.recorded_grad_norm, rel=1e-5)
    rows = show_task(workspace, "fixture-moe").experiments
    assert [(r.config_id, r.verdict) for r in rows] == [("mismatch_token_clip_max=2", "cleared")]
    assert rows[0].result_path == str(Path(result.output_dir) / "replay_result.json")
