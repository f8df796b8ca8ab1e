"""Our `verl` loss convention against verl 0.9.1's own installed functions, on the same float64 batches.

Two DP ranks with varied response lengths (one empty), log-ratios past verl's +-20 clamp, reference
log-probs past its k3 clamp, rollout mismatch outliers and mixed-sign advantages; every setting must
agree within 1e-7 relative on each rank's loss and on its gradient with respect to the logprobs,
verl's side computed by its own `ppo_loss`. verl's files are executed from the installed package
(see verl_peer.py for the stand-ins its unavailable imports get, and why). The batches are checked
to reach what the settings are there to test, so a later edit of them cannot quietly turn a case
into one that passes whatever we compute.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from verl_cases import CASES, DP, compare, rank_batch

from axrl_spike_replay.capture.reference.toy_task import grpo_advantages
from axrl_spike_replay.training.verl_convention import KL_CLAMP, SAFETY_BOUND, kl_penalty

TOLERANCE = 1e-7


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    from verl_peer import load_verl, skip_unless_installed

    skip_unless_installed()
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


def test_the_batches_reach_verls_clamps() -> None:
    """On every rank's loss mask: k3 past its +-10 clamp on both sides of the reference, and a negative-advantage
    token whose log-ratio is past +20 (the `kl *` and `dual clip c=1e12` cases read them)."""
    for rank in range(DP):
        r = rank_batch(rank)
        on = r["response_mask"]
        kl = (r["ref_log_prob"] - r["log_probs"])[on]  # k3's argument
        assert ((kl > 0) & (kl.exp() - kl - 1 > KL_CLAMP)).any(), "a reference above the policy, past the clamp"
        assert (kl < -SAFETY_BOUND).any(), "a reference far below it, past the +-20 clamp as well"
        log_ratio, adv = (r["log_probs"] - r["old_log_probs"])[on], r["advantages"][on]
        assert ((log_ratio > SAFETY_BOUND) & (adv < 0)).any(), "a negative-advantage token past the +-20 clamp"


def test_the_batches_hold_tokens_between_asymmetric_k1_bounds_and_their_mirror_image() -> None:
    """pi_rollout/pi_train inside [0.25, 2] but not [0.5, 4], and the other way round: on these tokens a
    rejection that reads the ratio inverted (k1's sign, or our mask's bounds not inverted) keeps other tokens."""
    for rank in range(DP):
        r = rank_batch(rank)
        ratio = (r["rollout_log_probs"] - r["old_log_probs"])[r["response_mask"]].exp()
        assert ((ratio > 0.25) & (ratio < 0.5)).any() and ((ratio > 2.0) & (ratio < 4.0)).any()


def test_k3s_log_ratio_clamp_matches_verls_where_exp_would_overflow(verl: dict[str, Any]) -> None:
    """k3 clamps ref - logprob to +-20 before exp and then k3 itself to +-10. Past |20| k3 is above 10 either
    way, so neither the loss nor the gradient of a batch shows the inner clamp; only exp's overflow does
    (ref - logprob > 709 in float64: without the clamp, k3's gradient is 0 * inf = NaN). So it is checked
    here, at the function level, against verl's own kl_penalty."""
    ref = torch.tensor([-800.0, -30.0, -6.0, -0.5, 0.0, 0.5, 6.0, 30.0, 800.0], dtype=torch.float64)
    for estimator in ("k3", "low_var_kl", "k3+"):
        ours_lp = torch.zeros_like(ref, requires_grad=True)
        theirs_lp = torch.zeros_like(ref, requires_grad=True)
        ours = kl_penalty(ours_lp, ref, estimator)
        theirs = verl["core_algos"].kl_penalty(logprob=theirs_lp, ref_logprob=ref, kl_penalty=estimator)
        ours.sum().backward()
        theirs.sum().backward()
        assert ours_lp.grad is not None and theirs_lp.grad is not None
        assert torch.equal(ours, theirs), estimator
        assert torch.isfinite(ours_lp.grad).all(), estimator
        assert torch.equal(ours_lp.grad, theirs_lp.grad), estimator


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


def test_every_kl_estimator_choice_is_verls_kl_penalty(verl: dict[str, Any]) -> None:
    """The `kl_estimator` lever under the axrl convention: every estimator but axrl's own k3 is verl's kl_penalty,
    forward and gradient; `kl_clamp: 10` on low_var_kl is verl's own clamp; axrl's k3 is the unclamped formula."""
    from axrl_spike_replay.training.loss_config import KL_ESTIMATORS, LossConfig
    from axrl_spike_replay.training.policy_loss import axrl_kl

    g = torch.Generator().manual_seed(0)
    ref = torch.cat([torch.randn(64, generator=g, dtype=torch.float64) * 4, torch.tensor([-30.0, 12.0, 30.0])])
    base = -torch.rand(ref.shape, generator=g, dtype=torch.float64) * 3
    for estimator in KL_ESTIMATORS:
        if estimator == "k3":
            continue
        ours_lp, theirs_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
        ours = axrl_kl(ours_lp, ref, LossConfig(kl_estimator=estimator))
        theirs = verl["core_algos"].kl_penalty(logprob=theirs_lp, ref_logprob=ref, kl_penalty=estimator)
        ours.sum().backward()
        theirs.sum().backward()
        assert torch.allclose(ours, theirs, rtol=1e-12, atol=0), estimator
        assert ours_lp.grad is not None and theirs_lp.grad is not None
        assert torch.allclose(ours_lp.grad, theirs_lp.grad, rtol=1e-12, atol=0), estimator
    clamped = axrl_kl(base, ref, LossConfig(kl_estimator="low_var_kl", kl_clamp=10.0))
    assert torch.equal(clamped, verl["core_algos"].kl_penalty(logprob=base, ref_logprob=ref, kl_penalty="low_var_kl"))
    delta = ref - base
    own = axrl_kl(base, ref, LossConfig())
    assert torch.allclose(own, delta.exp() - delta - 1.0) and float(own.max()) > KL_CLAMP  # unclamped
    bound = axrl_kl(base, ref, LossConfig(kl_clamp=2.0))
    assert float(bound.max()) == 2.0 and torch.equal(bound, own.clamp(max=2.0))
    for estimator in ("k1", "k2", "abs"):  # the other estimators take the clamp alike
        assert float(axrl_kl(base, ref, LossConfig(kl_estimator=estimator, kl_clamp=1.5)).abs().max()) <= 1.5
