"""The `stale_routes` preset: a genuine routing fault on a transformers MoE policy trips the spike guard.

During the burst the rollout engine's routing payload is one token behind the tokens; routing replay forces
those routes in the training forward, on a policy whose experts differ, so the trainer's log-probs move by
tens of nats and the k3 KL penalty (and the ratios against the rollout log-probs) blow up. The spike replays
bit for bit, and turning routing replay off (diagnostic) shows the routes are what blew it up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from axrl_spike_replay.capture.reference.reference_trainer import CaptureResult, capture_reference_run
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay

BURST_START = 20  # the preset's burst: iterations 20-22


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory: pytest.TempPathFactory) -> CaptureResult:
    return capture_reference_run(
        tmp_path_factory.mktemp("stale-routes"),
        world_size=2,
        steps=BURST_START,
        preset="stale_routes",
        model="qwen3_moe",
        job="stale-routes",
    )


def _burst_snapshot(run: CaptureResult) -> Path:
    return next(p for p in run.snapshot_dirs if p.name == f"iter_{BURST_START:07d}")


@pytest.mark.slow
def test_the_shifted_routing_payload_trips_the_guard_with_a_real_spike(stale_run: CaptureResult) -> None:
    assert BURST_START in stale_run.spike_iterations, stale_run.grad_norms
    ratio = stale_run.spike_ratios[stale_run.spike_iterations.index(BURST_START)]
    assert ratio >= 5.0
    doc = yaml.safe_load((_burst_snapshot(stale_run) / "run_config.yaml").read_text())
    assert doc["train"]["fault"] == {"route_shift": 1}
    assert doc["loss"]["is_base_logprobs"] == "rollout"
    assert doc["routing"]["replay"] == "all"


@pytest.mark.slow
def test_replay_reproduces_the_spike_and_routing_replay_off_shows_the_routes_caused_it(
    stale_run: CaptureResult,
) -> None:
    snapshot = _burst_snapshot(stale_run)
    full = run_replay(replay_request(What(snapshot), how=How(nproc=2)))
    assert full.fidelity == "full" and full.verdict == "reproduced"
    assert full.grad_norm == full.recorded_grad_norm  # bit for bit: same code, same kernels, same order
    off = run_replay(replay_request(What(snapshot, mitigations={"routing_replay": "off"}), how=How(nproc=2)))
    assert off.grad_norm is not None and full.grad_norm is not None
    assert off.grad_norm < full.grad_norm / 5  # the trainer's own routes: no blow-up
