"""Our `verl` loss convention against verl 0.9.1's own installed functions, on the same float64 batches.

Two DP ranks with varied response lengths (one empty), log-ratios past verl's +-20 clamp, rollout
mismatch outliers and mixed-sign advantages; every setting must agree within 1e-7 relative on each
rank's loss and on its gradient with respect to the logprobs. verl's files are executed from the
installed package (see verl_peer.py for the stand-ins its unavailable imports get).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from verl_cases import CASES, compare

from axrl_spike_replay.capture.toy_task import grpo_advantages

TOLERANCE = 1e-7


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    from verl_peer import load_verl

    peer = load_verl()
    assert peer["version"] == "0.9.1"
    return peer


@pytest.mark.parametrize("name", list(CASES))
def test_our_verl_convention_matches_verl_on_loss_and_gradient(name: str, verl: dict[str, Any]) -> None:
    for seed in (0, 1):
        figures = compare(CASES[name], verl, seed)
        assert np.isfinite(figures["ours"]) and np.isfinite(figures["verl"])
        assert figures["loss_rel"] <= TOLERANCE, figures
        assert figures["grad_rel"] <= TOLERANCE, figures


def test_grpo_advantages_take_verls_bessel_corrected_group_std(verl: dict[str, Any]) -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 3.0, -1.0, 2.0, 0.0])
    ours = grpo_advantages(rewards.double(), group_size=4, unbiased=True)
    index = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    scores = torch.zeros(8, 5, dtype=torch.float64)
    scores[:, -1] = rewards.double()
    theirs, _ = verl["core_algos"].compute_grpo_outcome_advantage(scores, torch.ones(8, 5), index)
    assert torch.allclose(ours.double(), theirs[:, 0], rtol=1e-6, atol=0)
    population = grpo_advantages(rewards.double(), group_size=4)  # axrl keeps the population std
    assert not torch.allclose(population.double(), theirs[:, 0], rtol=1e-3)
