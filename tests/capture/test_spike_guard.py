"""The spike guard in a user's loop: snapshot on a trip, then log, skip or roll back; rotation; atomic writes."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.snapshot_writer import RankPayload
from axrl_spike_replay.capture.spike_guard import SpikeGuard
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.rank_data import load_rank_batch


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _backward(model: nn.Module, scale: float = 1.0) -> float:
    x = torch.ones(2, 4)
    ((model(x) * scale) ** 2).mean().backward()
    return float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())


def _guard(root: Path, **kwargs) -> SpikeGuard:
    kwargs.setdefault("detector", MedianRatioDetector(window=4, threshold=5.0, warmup=2))
    return SpikeGuard(root, job_name="user-job", **kwargs)


def _payload(step: int) -> dict[int, RankPayload]:
    batch = {"tokens": torch.full((2, 5), step, dtype=torch.int64), "loss_mask": torch.ones(2, 5)}
    return {0: RankPayload(batch=batch, grad_info={"grad_norm": float(step), "param_grad_norms": {}})}


def _warm(guard: SpikeGuard, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(1, steps + 1):
        decision = guard.observe(step, _backward(model))
        assert guard.apply(decision, model, optimizer)
        optimizer.step()
        optimizer.zero_grad()


def test_skip_drops_the_spike_step_and_snapshots_the_weights_before_it(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    guard = _guard(tmp_path, action="skip")
    _warm(guard, model, optimizer)
    before = copy.deepcopy(model.state_dict())
    adam_before = copy.deepcopy(optimizer.state_dict())

    decision = guard.observe(4, _backward(model, scale=100.0))
    assert decision.tripped and decision.action == "skip" and decision.spike_ratio > 5
    path = guard.snapshot(decision, model.state_dict(), _payload(4))
    assert not guard.apply(decision, model, optimizer)
    assert all(p.grad is None for p in model.parameters())

    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optimizer.state_dict()["state"][0]["step"] == adam_before["state"][0]["step"]
    meta, legacy = read_metadata(path)
    assert (meta.iteration, meta.job_name, legacy) == (4, "user-job", False)
    assert meta.grad_norm == decision.grad_norm and meta.median_norm == decision.median_norm
    assert torch.equal(load_rank_batch(path, 0)["tokens"], torch.full((2, 5), 4))


def test_log_only_lets_the_step_through(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    guard = _guard(tmp_path, action="log")
    _warm(guard, model, optimizer)
    decision = guard.observe(4, _backward(model, scale=100.0))
    assert decision.tripped and decision.action == "log"
    assert guard.apply(decision, model, optimizer)
    assert all(p.grad is not None for p in model.parameters())


def test_rollback_restores_model_and_optimizer_to_the_last_checkpoint(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    guard = _guard(tmp_path, action="rollback")
    _warm(guard, model, optimizer, steps=2)
    guard.checkpoint(2, model, optimizer)
    checkpoint_model = copy.deepcopy(model.state_dict())
    checkpoint_adam = copy.deepcopy(optimizer.state_dict())
    _warm(guard, model, optimizer, steps=2)  # steps after the checkpoint move the weights on
    assert not torch.equal(model.weight, checkpoint_model["weight"])

    decision = guard.observe(5, _backward(model, scale=100.0))
    assert decision.tripped and not guard.apply(decision, model, optimizer)
    assert guard.last_checkpoint_step == 2
    assert all(torch.equal(checkpoint_model[k], v) for k, v in model.state_dict().items())
    restored = optimizer.state_dict()["state"]
    assert all(torch.equal(checkpoint_adam["state"][0][k], restored[0][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert all(p.grad is None for p in model.parameters())


def test_rollback_before_any_checkpoint_skips_instead(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    guard = _guard(tmp_path, action="rollback")
    _warm(guard, model, optimizer)
    before = copy.deepcopy(model.state_dict())
    decision = guard.observe(4, _backward(model, scale=100.0))
    assert not guard.apply(decision, model, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rotation_keeps_the_newest_keep_last(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    guard = _guard(tmp_path, keep_last=2, detector=MedianRatioDetector(window=3, threshold=2.0, warmup=1))
    guard.observe(1, 1.0)
    for step in (2, 3, 4, 5):
        decision = guard.observe(step, 100.0)
        guard.snapshot(decision, model.state_dict(), _payload(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000005"]
    assert [p.name for p in guard.snapshots] == ["iter_0000004", "iter_0000005"]


_KILLED_WRITER = """
import sys, time, torch
from pathlib import Path
from torch import nn
from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.snapshot_writer import RankPayload
from axrl_spike_replay.capture.spike_guard import SpikeGuard

root, marker = Path(sys.argv[1]), Path(sys.argv[2])

class Stall:  # pickling it signals the test, then blocks until the process is killed
    def __reduce__(self):
        marker.write_text("writing")
        time.sleep(120)
        return (int, (0,))

guard = SpikeGuard(root, detector=MedianRatioDetector(window=3, threshold=2.0, warmup=1))
guard.observe(1, 1.0)
decision = guard.observe(7, 100.0)
batch = {"tokens": torch.zeros(2, 3, dtype=torch.int64), "loss_mask": torch.ones(2, 3), "stall": Stall()}
guard.snapshot(decision, nn.Linear(4, 1).state_dict(), {0: RankPayload(batch, {"grad_norm": 100.0})})
"""


def test_a_writer_killed_midway_leaves_nothing_under_iter_n_and_the_next_snapshot_sweeps_it(tmp_path: Path) -> None:
    root, marker = tmp_path / "spike_snapshots", tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(root), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the writer never reached the middle of the snapshot"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (root / "iter_0000007").exists()
    assert [p.name for p in root.iterdir()] == [".iter_0000007.writing"]

    model, _ = _model_and_optimizer()
    guard = _guard(root, detector=MedianRatioDetector(window=3, threshold=2.0, warmup=1))
    guard.observe(8, 1.0)
    guard.snapshot(guard.observe(9, 100.0), model.state_dict(), _payload(9))
    assert [p.name for p in root.iterdir()] == ["iter_0000009"]


def test_bad_guard_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="action must be one of"):
        SpikeGuard(tmp_path, action="panic")
    with pytest.raises(ConfigError, match="keep_last"):
        SpikeGuard(tmp_path, keep_last=0)
