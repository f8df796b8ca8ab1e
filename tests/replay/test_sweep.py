"""Sweeping mitigations on a captured ratio-outlier spike: one run, every config judged against the baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.experiment.result import SweepResult
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.replay.compute.process_inputs import forward_groups
from axrl_spike_replay.training.policy_loss import LossConfig
from axrl_spike_replay.training.routing_replay import RoutingConfig
from axrl_spike_replay.workspace.task_record.task_state import show_task

CONFIGS = [
    {"mismatch_token_clip_max": 2},
    {"ratio_outlier_mask": True},
    {"advantage_clip": 0.5},
    {"log_ratio_clip": 0.2},
    {"is_base_logprobs": "old"},
    {"loss_agg_mode": "seq-mean-token-sum"},
    {"balance_negative_advantages": True},
    {"kl_coef": 0.1, "entropy_coef": 0.01},
    {"routing_replay": "off"},
]


@pytest.fixture(scope="module")
def sweep(spike_snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[SweepResult, Path]:
    ws = tmp_path_factory.mktemp("sweep-ws")
    open_task(ws, "fixture-moe", spike_snapshot)
    return run_request(
        replay_request(
            What(spike_snapshot, verb="sweep", configs=CONFIGS),
            how=How(nproc=1),
            workspace=ws,
        )
    ), ws


def test_every_config_gets_a_result_in_order_with_its_verdict(sweep: tuple[SweepResult, Path]) -> None:
    result, _ = sweep
    assert result.baseline.verdict == "reproduced" and result.fidelity == "full"
    assert [r.mitigations for r in result.results] == [parse_config(c) for c in CONFIGS]
    for r in result.results:
        assert r.baseline_grad_norm == result.baseline.grad_norm
        assert r.change_vs_baseline == pytest.approx(r.grad_norm / result.baseline.grad_norm - 1)
        assert r.spike_ratio == pytest.approx(r.grad_norm / r.median_norm)
        assert r.verdict in ("cleared", "partial", "no_effect", "worse")
    verdicts = {r.config_id: r.verdict for r in result.results}
    # the burst's wrong rollout logprobs are what the ratio-outlier mitigations target
    assert verdicts["mismatch_token_clip_max=2"] == "cleared"
    assert verdicts["ratio_outlier_mask"] == "cleared"
    assert verdicts["is_base_logprobs=old"] == "cleared"
    assert {r.config_id for r in result.cleared()} >= {"mismatch_token_clip_max=2", "ratio_outlier_mask"}


def test_each_config_has_its_result_file_under_the_same_timestamp(sweep: tuple[SweepResult, Path]) -> None:
    result, _ = sweep
    out = Path(result.output_dir)
    assert json.loads((out / "baseline" / "replay_result.json").read_text())["verdict"] == "reproduced"
    for r in result.results:
        assert Path(r.output_dir) == out / r.config_id
        assert json.loads((out / r.config_id / "replay_result.json").read_text())["grad_norm"] == r.grad_norm
    doc = json.loads((out / "sweep_result.json").read_text())
    assert SweepResult.from_json(doc).results[0].config_id == result.results[0].config_id
    assert "axrl-spike-replay sweep" in (out / "command.txt").read_text()


def test_every_config_is_logged_in_the_open_task(sweep: tuple[SweepResult, Path]) -> None:
    result, ws = sweep
    rows = show_task(ws, "fixture-moe").experiments
    assert [r.config_id for r in rows] == ["baseline"] + [r.config_id for r in result.results]


def test_loss_level_configs_share_the_baselines_forward() -> None:
    loss, routing = LossConfig(), RoutingConfig(replay="all")
    applied = [apply_config(parse_config(c), loss, routing) for c in [{}, *CONFIGS]]
    groups = [[c.config_id for c in group] for group in forward_groups(applied)]
    assert len(groups) == 2  # every loss-level config with the baseline; routing off on its own
    assert groups[1] == ["routing_replay=off"]
    assert len(groups[0]) == len(CONFIGS)


def test_a_sweep_matches_separate_replays(spike_snapshot: Path, sweep: tuple[SweepResult, Path]) -> None:
    from axrl_spike_replay.replay.engine import run_replay

    result, _ = sweep
    alone = run_replay(replay_request(What(spike_snapshot, mitigations=CONFIGS[2]), how=How(nproc=1)))
    shared = result.results[2]
    assert shared.grad_norm == pytest.approx(alone.grad_norm, rel=1e-12)
    assert shared.verdict == alone.verdict
