"""Route 1's mitigations on a Megatron snapshot: a sweep of two mitigations over the snapshot megatron-core's own
training loop wrote (EP=2, its burst two samples whose rollout log-probs fall far below the policy's) replays the
baseline and both configs at full fidelity, judges each against the baseline, writes each one's result and logs
every run in the open task; a config replayed alone gives the norm the sweep's shared forward gave it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.experiment.mitigation.mitigations import parse_config
from axrl_spike_replay.experiment.result import SweepResult
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.workspace.task_record.task_state import show_task

pytestmark = pytest.mark.slow

CONFIGS = [{"mismatch_token_clip_max": 2}, {"advantage_clip": 0.5}]
JOB = "megatron-ep2"


def test_a_sweep_of_two_mitigations_on_a_megatron_snapshot(megatron_capture: Path, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    open_task(workspace, JOB, megatron_capture)
    result = run_request(replay_request(What(megatron_capture, verb="sweep", configs=CONFIGS), workspace=workspace))
    assert isinstance(result, SweepResult)
    assert (result.baseline.verdict, result.fidelity, result.world_size_used) == ("reproduced", "full", 2)
    assert [r.mitigations for r in result.results] == [parse_config(c) for c in CONFIGS]
    baseline = result.baseline.grad_norm
    assert baseline is not None
    verdicts = {r.config_id: r.verdict for r in result.results}
    # the burst's rollout log-probs are what the mismatch clip masks; clipping the advantages shrinks the burst's
    # weight without removing it
    assert verdicts["mismatch_token_clip_max=2"] == "cleared"
    assert verdicts["advantage_clip=0.5"] in ("cleared", "partial")
    for r in result.results:
        assert r.grad_norm is not None and r.grad_norm < baseline
        assert r.change_vs_baseline == pytest.approx(r.grad_norm / baseline - 1)

    out = Path(result.output_dir)
    assert json.loads((out / "baseline" / "replay_result.json").read_text())["verdict"] == "reproduced"
    for r in result.results:
        assert json.loads((out / r.config_id / "replay_result.json").read_text())["grad_norm"] == r.grad_norm
    rows = show_task(workspace, JOB).experiments
    assert [row.config_id for row in rows] == ["baseline"] + [r.config_id for r in result.results]

    alone = run_replay(replay_request(What(megatron_capture, mitigations=dict(CONFIGS[0]))))
    swept = result.results[0].grad_norm
    assert alone.grad_norm is not None and swept is not None
    assert abs(alone.grad_norm - swept) / swept < 1e-6  # the sweep's shared forward, the config's own replay
