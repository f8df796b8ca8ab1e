"""The newer objectives as mitigations under the axrl and verl conventions: what each sets there, what is refused
and why, and that each computes TRL's objective of the same name where the two are the same math.

Each side is checked against its own peer elsewhere: the trl convention against TRL's `_compute_loss`
(tests/training/test_trl_crosscheck.py), `policy_loss_mode` and `rollout_is` under verl against verl's own losses
(tests/training/test_verl_objectives.py, test_verl_crosscheck.py). Here the mitigation under axrl and verl is
computed beside the same mitigation under trl, on float64 batches (5 seeds) whose ratios reach every clip, cap and
mask, and the loss and its gradient must agree within 1e-9 relative under verl (which keeps float64) and 1e-5 under
axrl (which computes in float32, its convention's precision): GSPO (TRL with bnpo's per-micro-batch token mean),
SAPO (TRL's grpo aggregation), CISPO (TRL's cap epsilon_high is verl's 1 + clip_ratio_high with no lower clip),
delta (the dual clip at c = delta) and the rollout correction (verl's TIS and IcePop).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.policy_loss import policy_loss
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.training.trl_settings import TrlSettings

B, PROMPT, T = 6, 2, 10


def _apply(mitigation: dict[str, Any], loss: LossConfig) -> LossConfig:
    return apply_config(parse_config(mitigation), loss, RoutingConfig()).loss


@pytest.mark.parametrize("convention", ["axrl", "verl"])
def test_each_objective_sets_the_conventions_own_setting(convention: str) -> None:
    base = LossConfig(convention=convention, dual_clip_c=3.0)
    gspo = _apply({"importance_sampling_level": "sequence"}, base)
    assert gspo.policy_loss_mode == "gspo" and gspo.dual_clip_c is None  # GSPO has no dual clip
    assert _apply({"importance_sampling_level": "token"}, base) == base
    assert _apply({"trl_loss_type": "cispo"}, base).policy_loss_mode == "cispo"
    sapo = _apply({"trl_loss_type": "sapo", "sapo_temperatures": "0.5:2"}, base)
    assert (sapo.policy_loss_mode, sapo.sapo_tau_pos, sapo.sapo_tau_neg) == ("sapo", 0.5, 2.0)
    # verl's SAPO aggregates per sequence whatever loss_agg_mode says; axrl's reads loss_agg_mode, so it is set
    assert sapo.loss_agg_mode == ("seq-mean-token-mean" if convention == "axrl" else "token-mean")
    aggregations = {"dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm", "grpo": "seq-mean-token-mean"}
    for loss_type, agg in aggregations.items():
        applied = _apply({"trl_loss_type": loss_type}, base)
        assert (applied.policy_loss_mode, applied.loss_agg_mode) == ("vanilla", agg)
    assert _apply({"delta": 1.5}, base).dual_clip_c == 1.5
    # a snapshot trained with one objective replays another in its place, or PPO's clip again
    recorded = LossConfig(convention=convention, policy_loss_mode="gspo")
    assert _apply({"trl_loss_type": "sapo"}, recorded).policy_loss_mode == "sapo"
    assert _apply({"importance_sampling_level": "token"}, recorded).policy_loss_mode == "vanilla"
    assert _apply({"trl_loss_type": "dapo"}, recorded).policy_loss_mode == "gspo"  # TRL's dapo keeps GSPO's ratio
    tis = _apply({"rollout_correction": "token_truncate:2"}, base)
    assert (tis.rollout_is, tis.rollout_is_threshold) == ("token", "2")
    icepop = _apply({"rollout_correction": "sequence_mask:0.5:2"}, base)
    assert (icepop.rollout_is, icepop.rollout_is_threshold) == ("sequence", "0.5_2.0")


@pytest.mark.parametrize("convention", ["axrl", "verl"])
@pytest.mark.parametrize(
    ("mitigation", "why"),
    [
        ({"trl_loss_type": "vespo"}, r"verl 0\.9\.1 has no VESPO loss"),
        ({"delta": 1.1}, r"delta >= 1 \+ clip_eps_high = 1\.2"),
        ({"rollout_correction": "token_truncate:0.5:2"}, r"truncates above only"),
        ({"rollout_correction": "sequence_mask:3"}, r"masks between two bounds"),
        ({"importance_sampling_level": "sequence", "trl_loss_type": "cispo"}, r"computes one policy objective"),
        ({"trl_loss_type": "sapo", "delta": 1.5}, r"delta has no meaning with policy_loss_mode sapo"),
    ],
)
def test_what_the_convention_cannot_compute_is_refused_naming_why(convention: str, mitigation: dict, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        _apply(mitigation, LossConfig(convention=convention))


def _batch(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Prompt + completion columns; every completion non-empty; log-ratios up to +-1.5 (past every clip, cap and
    mask used here, within verl's clamps); rollout mismatches up to +-1; mixed-sign advantages."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([8, 3, 6, 1, 8, 5])
    mask = torch.zeros(B, T, dtype=torch.float64)
    for row, n in enumerate(lengths.tolist()):
        mask[row, PROMPT : PROMPT + n] = 1.0
    logprobs = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05
    old = logprobs - (torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 1.5)
    rollout = old - (torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 - 1.0)
    adv = torch.randn(B, generator=gen, dtype=torch.float64) * 2
    adv[0], adv[1] = -abs(float(adv[0])) - 0.5, abs(float(adv[1])) + 0.5
    batch = {
        "loss_mask": mask,
        "advantages": adv,
        "old_logprobs": old,
        "rollout_logprobs": rollout,
        "num_items_in_batch": mask.sum(),
    }
    return logprobs, batch


def _loss_and_grad(cfg: LossConfig, seed: int) -> tuple[float, torch.Tensor]:
    logprobs, batch = _batch(seed)
    logprobs.requires_grad_(True)
    loss = policy_loss(logprobs, batch, cfg).loss
    loss.backward()
    assert logprobs.grad is not None
    return float(loss.detach()), logprobs.grad


# name -> (mitigation, TRL's loss type and clips, the other conventions' aggregation and clips)
SAME_MATH: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "GSPO": ({"importance_sampling_level": "sequence"}, {"loss_type": "bnpo"}, {}),
    "SAPO, temperatures 0.5:2": (
        {"trl_loss_type": "sapo", "sapo_temperatures": "0.5:2"},
        {"loss_type": "dapo"},
        {"loss_agg_mode": "seq-mean-token-mean"},
    ),
    "CISPO, weights capped at 2": (
        {"trl_loss_type": "cispo"},
        {"loss_type": "dapo", "clip_eps_high": 2.0},
        {"clip_eps_low": 1.0, "clip_eps_high": 1.0},
    ),
    "delta 1.5": ({"delta": 1.5}, {"loss_type": "bnpo"}, {}),
    "rollout correction token_mask:0.5:2": ({"rollout_correction": "token_mask:0.5:2"}, {"loss_type": "bnpo"}, {}),
    "rollout correction sequence_truncate:2": (
        {"rollout_correction": "sequence_truncate:2"},
        {"loss_type": "bnpo"},
        {},
    ),
    "rollout correction token_truncate:1.5": (
        {"rollout_correction": "token_truncate:1.5"},
        {"loss_type": "bnpo"},
        {},
    ),
}


@pytest.mark.parametrize("convention", ["axrl", "verl"])
@pytest.mark.parametrize("name", list(SAME_MATH))
def test_each_objective_computes_trls_objective_of_the_same_name(convention: str, name: str) -> None:
    mitigation, trl_side, other_side = SAME_MATH[name]
    trl_side = dict(trl_side)
    trl = LossConfig(
        convention="trl",
        clip_eps_high=trl_side.pop("clip_eps_high", 0.2),
        trl=TrlSettings(loss_type=trl_side.pop("loss_type")),
    )
    # verl's dual clip is on by default (c = 3): off only with a c past every ratio here (e^1.5 = 4.5)
    dual = {"dual_clip_c": 1e6} if convention == "verl" and "delta" not in mitigation else {}
    other = LossConfig(convention=convention, normalization="per_rank", **{**dual, **other_side})
    trl_cfg, other_cfg = _apply(mitigation, trl), _apply(mitigation, other)
    tolerance = 1e-9 if convention == "verl" else 1e-5
    for seed in range(5):
        trl_loss, trl_grad = _loss_and_grad(trl_cfg, seed)
        ours, grad = _loss_and_grad(other_cfg, seed)
        assert abs(ours - trl_loss) <= tolerance * abs(trl_loss), (seed, ours, trl_loss)
        assert float((grad - trl_grad).abs().max()) <= tolerance * float(trl_grad.abs().max()), seed
        untouched, _ = _loss_and_grad(trl, seed)
        assert abs(untouched - trl_loss) > 1e-6 * abs(trl_loss), f"{name} does not reach this batch (seed {seed})"
