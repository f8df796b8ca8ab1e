"""The recovery drill: with the guard a poisoned burst never lands; without it the run carries the scar."""

from __future__ import annotations

import pytest
import torch
from capture_helpers import final_weights_distance
from torch import nn

from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
from axrl_spike_replay.capture.reference.run_config import DEFAULT_MODEL
from axrl_spike_replay.capture.spike_guard import SpikeGuard
from axrl_spike_replay.models.tiny_moe import TinyMoEPolicy

BURST = [20, 21, 22]


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> dict:
    runs = {
        "guarded": {},  # guard_action skip (the default)
        "never_saw_burst": {"train": {"skip_iterations": BURST}},
        "unguarded": {"train": {"guard_action": "log"}},
    }
    return {
        name: capture_reference_run(
            tmp_path_factory.mktemp(name), preset="ratio_outliers", steps=26, overrides=ov, keep_final_state=True
        )
        for name, ov in runs.items()
    }


def test_with_the_guard_the_burst_never_lands(drill) -> None:
    guarded, clean = drill["guarded"], drill["never_saw_burst"]
    assert guarded.spike_iterations == BURST and clean.spike_iterations == []
    assert all(torch.equal(guarded.final_state[k], clean.final_state[k]) for k in clean.final_state)


def test_without_the_guard_the_run_carries_the_scar(drill) -> None:
    unguarded, clean = drill["unguarded"], drill["never_saw_burst"]
    assert unguarded.spike_iterations == BURST  # detected and logged, but applied
    torch.manual_seed(0)
    initial = TinyMoEPolicy(DEFAULT_MODEL).state_dict()
    scar = final_weights_distance(unguarded.final_state, clean.final_state)
    training = final_weights_distance(clean.final_state, initial)
    assert scar > 0.1 * training  # three poisoned steps moved the weights by a tenth of all of training


def _regression_loop(guard: SpikeGuard | None, poisoned: set[int], steps: int = 60) -> float:
    """A user's loop: linear regression with momentum SGD; `poisoned` batches carry labels scaled by 1e4."""
    torch.manual_seed(0)
    true_w = torch.randn(8, 1)
    model = nn.Linear(8, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    if guard is not None:
        guard.checkpoint(0, model, optimizer)
    for step in range(1, steps + 1):
        x = torch.randn(32, 8, generator=data)
        y = x @ true_w * (1e4 if step in poisoned else 1.0)
        ((model(x) - y) ** 2).mean().backward()
        grad_norm = float(model.weight.grad.norm())
        if guard is None or guard.apply(guard.observe(step, grad_norm), model, optimizer):
            optimizer.step()
        optimizer.zero_grad()
        if guard is not None and step % 10 == 0:
            guard.checkpoint(step, model, optimizer)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return float(((model(x) - x @ true_w) ** 2).mean())


def test_rollback_keeps_a_user_loop_healthy_through_a_poisoned_burst(tmp_path) -> None:
    poisoned = {35, 36, 37}
    guard = SpikeGuard(tmp_path, action="rollback", detector=MedianRatioDetector(window=10, threshold=5.0, warmup=5))
    healthy = _regression_loop(None, set())
    guarded = _regression_loop(guard, poisoned)
    unguarded = _regression_loop(None, poisoned)
    assert [d.step for d in guard.trips] == sorted(poisoned)
    assert guarded < 10 * healthy + 1e-3
    assert unguarded > 100 * guarded
