"""Each loss-level mitigation changes the replayed loss exactly as its definition says.

One small batch (3 samples, 5 positions, 4 loss tokens) is worked through by hand below; every
expected value is written out from the mitigation's definition, independent of `policy_loss`.
"""

from __future__ import annotations

import math

import pytest
import torch

from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.training.policy_loss import LossConfig, policy_loss
from axrl_spike_replay.training.routing_replay import RoutingConfig

E = math.e
LP = [[0, -1.0, -0.5, 0, 0], [0, -0.5, -1.0, 0, 0], [0, -1.0, 0, 0, 0]]  # current policy
OLD = [[0, -1.2, -0.5, 0, 0], [0, -1.5, -1.0, 0, 0], [0, -0.5, 0, 0, 0]]
ROLLOUT = [[0, -1.0, -1.5, 0, 0], [0, -3.0, -1.0, 0, 0], [0, -0.7, 0, 0, 0]]
REF = [[0, -1.1, -0.4, 0, 0], [0, -0.5, -1.2, 0, 0], [0, -1.0, 0, 0, 0]]
MASK = [[0, 1, 1, 0, 0], [0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
ADV = [1.0, -2.0, -1.0]
ENTROPY = [[0, 0.5, 0.3, 0, 0], [0, 0.2, 0.9, 0, 0], [0, 0.4, 0, 0, 0]]

# The saved config: PPO clip 0.2, ratio against the old logprobs, token-mean, nothing else.
# Its per-token losses, max(-A r, -A clip(r, 0.8, 1.2)) with r = exp(lp - old):
A_ = -1.2  # sample 0, token 1: r = e^0.2 = 1.2214 -> clipped to 1.2, A = 1
B_ = -1.0  # sample 0, token 2: r = 1
C_ = 2 * E  # sample 1, token 1: r = e, A = -2 -> max(2e, 2.4) = 2e
D_ = 0.8  # sample 2, token 1: r = e^-0.5 = 0.6065, A = -1 -> max(0.6065, 0.8) = 0.8
BASELINE = (A_ + B_ + C_ + D_) / 4


def _batch() -> dict[str, torch.Tensor]:
    t = lambda rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
    return {
        "tokens": torch.zeros(3, 5, dtype=torch.long),
        "loss_mask": t(MASK),
        "advantages": t(ADV),
        "old_logprobs": t(OLD),
        "rollout_logprobs": t(ROLLOUT),
        "ref_logprobs": t(REF),
    }


def replayed_loss(config: dict, aux: float | None = None, z: float | None = None) -> float:
    """The loss the replay computes on the example batch with a mitigation config (parsed as the CLI does)."""
    applied = apply_config(parse_config(config), LossConfig(), RoutingConfig())
    entropy = torch.tensor(ENTROPY) if applied.loss.entropy_coef else None
    out = policy_loss(
        torch.tensor(LP),
        _batch(),
        applied.loss,
        entropy=entropy,
        aux_loss=None if aux is None else torch.tensor(aux),
        z_loss=None if z is None else torch.tensor(z),
    )
    return float(out.loss)


def test_no_mitigation_is_the_saved_loss() -> None:
    assert replayed_loss({}) == pytest.approx(BASELINE, rel=1e-6)


HAND_COMPUTED = {
    # truncated IS: weight min(exp(old - rollout), 2) on every token, ratio against old
    "mismatch_token_clip_max=2": (
        {"mismatch_token_clip_max": 2.0},
        (A_ * math.exp(-0.2) + B_ * 2 + C_ * 2 + D_ * math.exp(0.2)) / 4,
    ),
    # ratio vs rollout per token: 1, e, e^2.5, e^-0.3 -> only tokens in [0.5, 2] stay (s0t1, s2t1)
    "ratio_outlier_mask token": ({"ratio_outlier_mask": True}, (A_ + D_) / 2),
    # geometric mean per sequence: e^0.5, e^2.5, e^-0.3 -> sample 1 is masked
    "ratio_outlier_mask sequence": ({"ratio_outlier_mask": "sequence"}, (A_ + B_ + D_) / 3),
    # sample 1's advantage -2 clamps to -1.5: max(1.5e, 1.8) = 1.5e
    "advantage_clip=1.5": ({"advantage_clip": 1.5}, (A_ + B_ + 1.5 * E + D_) / 4),
    # log-ratios 0.2, 0, 1, -0.5 clamp to 0.1, 0, 0.1, -0.1 (all then inside the PPO clip)
    "log_ratio_clip=0.1": (
        {"log_ratio_clip": 0.1},
        (-math.exp(0.1) - 1 + 2 * math.exp(0.1) + math.exp(-0.1)) / 4,
    ),
    "seq-mean-token-mean": ({"loss_agg_mode": "seq-mean-token-mean"}, ((A_ + B_) / 2 + C_ + D_) / 3),
    "seq-mean-token-sum": ({"loss_agg_mode": "seq-mean-token-sum"}, (A_ + B_ + C_ + D_) / 3),
    "seq-mean-token-sum-norm": ({"loss_agg_mode": "seq-mean-token-sum-norm"}, (A_ + B_ + C_ + D_) / 5),
    # ratios against rollout: 1, e, e^2.5, e^-0.3
    "is_base_logprobs=rollout": ({"is_base_logprobs": "rollout"}, (-1 - 1.2 + 2 * math.exp(2.5) + 0.8) / 4),
    # sample 2: max(0.6065, 0.5) = e^-0.5
    "clip_eps_low=0.5": ({"clip_eps_low": 0.5}, (A_ + B_ + C_ + math.exp(-0.5)) / 4),
    # sample 0 token 1: max(-e^0.2, -1.1) = -1.1
    "clip_eps_high=0.1": ({"clip_eps_high": 0.1}, (-1.1 + B_ + C_ + D_) / 4),
    # negative advantages capped at -A * c: sample 1: min(2e, 4) = 4
    "dual_clip_c=2": ({"dual_clip_c": 2.0}, (A_ + B_ + 4 + D_) / 4),
    # k3 KL: exp(ref - lp) - (ref - lp) - 1 with ref - lp = -0.1, 0.1, 0, 0
    "kl_coef=2": (
        {"kl_coef": 2.0},
        (A_ + B_ + C_ + D_ + 2.0 * ((math.exp(-0.1) + 0.1 - 1) + (math.exp(0.1) - 0.1 - 1))) / 4,
    ),
    "entropy_coef=0.1": ({"entropy_coef": 0.1}, (A_ + B_ + C_ + D_ - 0.1 * (0.5 + 0.3 + 0.2 + 0.4)) / 4),
    # positives total 1 * 2 tokens = 2, negatives 2 + 1 = 3: negatives scale by 2/3 -> -4/3 and -2/3
    "balance_negative_advantages": (
        {"balance_negative_advantages": True},
        (A_ + B_ + (4 / 3) * E + (2 / 3) * 0.8) / 4,
    ),
}


@pytest.mark.parametrize("case", sorted(HAND_COMPUTED))
def test_mitigation_changes_the_loss_as_computed_by_hand(case: str) -> None:
    config, expected = HAND_COMPUTED[case]
    assert replayed_loss(config) == pytest.approx(expected, rel=1e-6)
    assert abs(replayed_loss(config) - BASELINE) > 1e-3


def test_router_loss_coefficients_add_their_losses() -> None:
    # aux 2.0 and z 3.0 from the forward; the saved config has both coefficients at 0
    assert replayed_loss({}, aux=2.0, z=3.0) == pytest.approx(BASELINE, rel=1e-6)
    assert replayed_loss({"aux_loss_coef": 0.5}, aux=2.0, z=3.0) == pytest.approx(BASELINE + 1.0, rel=1e-6)
    assert replayed_loss({"z_loss_coef": 0.1}, aux=2.0, z=3.0) == pytest.approx(BASELINE + 0.3, rel=1e-6)


def test_a_combination_applies_every_part() -> None:
    # advantage_clip 1.5 then dual clip 2: sample 1: min(max(1.5e, 1.8), 1.5 * 2 = 3) = 3
    config = {"advantage_clip": 1.5, "dual_clip_c": 2.0}
    assert replayed_loss(config) == pytest.approx((A_ + B_ + 3 + D_) / 4, rel=1e-6)
