"""Loss conventions on one rank's batch: -inf padding never reaches loss or gradient, the default convention is
today's, and mitigations without a verl meaning are refused by name."""

from __future__ import annotations

import pytest
import torch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.training.loss_config import LOSS_AGG_MODES, LossConfig
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.policy_loss import policy_loss
from axrl_spike_replay.training.routing_config import RoutingConfig


def _batch(pad: float) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    b, t = 4, 8
    mask = torch.zeros(b, t)
    mask[:, 3:] = 1.0
    mask[1, 5:] = 0.0
    mask[2] = 0.0  # an empty response
    off = mask == 0
    logprobs = -torch.rand(b, t, generator=gen) - 0.1
    batch = {
        "loss_mask": mask,
        "advantages": torch.tensor([1.0, -2.0, 0.5, -0.3]),
        "old_logprobs": logprobs + 0.1 * torch.randn(b, t, generator=gen),
        "rollout_logprobs": logprobs + 0.1 * torch.randn(b, t, generator=gen),
        "ref_logprobs": logprobs + 0.1 * torch.randn(b, t, generator=gen),
    }
    for key in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
        batch[key] = batch[key].masked_fill(off, pad)
    entropy = torch.rand(b, t, generator=gen).masked_fill(off, pad)
    return logprobs.masked_fill(off, pad), batch, entropy


SETTINGS = [
    {"convention": "axrl", "kl_coef": 0.1, "entropy_coef": 0.01, "mismatch_token_clip_max": 2.0},
    {"convention": "axrl", "ratio_outlier_mask": {"level": "sequence"}, "kl_coef": 0.1},
    *[
        {"convention": "verl", "loss_agg_mode": mode, "kl_coef": 0.1, "kl_estimator": est, "entropy_coef": 0.01}
        for mode in LOSS_AGG_MODES
        for est in ("k1", "k2", "k3")
    ],
    {"convention": "verl", "rollout_is": "sequence", "rollout_rs": "seq_max_k2,token_k1", "rollout_rs_threshold": 2},
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("pad", [float("-inf"), float("nan"), float("inf")])
def test_non_finite_padding_never_reaches_the_loss_or_the_gradient(setting: dict, pad: float) -> None:
    cfg = LossConfig.from_dict(setting)
    clean_lp, clean_batch, clean_ent = _batch(0.0)
    padded_lp, padded_batch, padded_ent = _batch(pad)
    results = []
    for lp, batch, ent in ((clean_lp, clean_batch, clean_ent), (padded_lp, padded_batch, padded_ent)):
        leaf = lp.clone().requires_grad_(True)
        out = policy_loss(leaf, batch, cfg, entropy=ent)
        out.loss.backward()
        assert leaf.grad is not None
        results.append((out.loss.detach(), leaf.grad))
    (clean_loss, clean_grad), (loss, grad) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, clean_loss) and torch.equal(grad, clean_grad)


def test_old_run_configs_keep_todays_convention() -> None:
    cfg = LossConfig.from_dict({"kl_coef": 0.01, "loss_agg_mode": "token-mean"})
    assert (cfg.convention, cfg.normalization, cfg.convention_version) == ("axrl", "per_rank", None)


def test_global_normalisation_needs_the_steps_counts() -> None:
    lp, batch, _ = _batch(0.0)
    cfg = LossConfig(convention="verl", normalization="global")
    with pytest.raises(ConfigError, match="global counts"):
        policy_loss(lp, batch, cfg)
    counts = GlobalCounts(dp_size=2, batch_num_tokens=2 * float(batch["loss_mask"].sum()), global_batch_size=8)
    assert torch.isfinite(policy_loss(lp, batch, cfg, counts=counts).loss)


def test_verl_only_settings_are_refused_under_axrl() -> None:
    with pytest.raises(ConfigError, match=r"rollout_rs.*convention verl"):
        LossConfig(rollout_rs="token_k1", rollout_rs_threshold=2.0)
    with pytest.raises(ConfigError, match="token-sum"):
        LossConfig(loss_agg_mode="token-sum")


@pytest.mark.parametrize(
    ("mitigation", "reason"),
    [
        ({"is_base_logprobs": "rollout"}, "is_base_logprobs=rollout has no meaning under convention verl"),
        ({"ratio_outlier_mask": {"base": "old"}}, "ratio_outlier_mask with base old has no meaning"),
        ({"balance_negative_advantages": True}, "balance_negative_advantages has no meaning"),
    ],
)
def test_mitigations_without_a_verl_meaning_are_refused_by_name(mitigation: dict, reason: str) -> None:
    saved = LossConfig(convention="verl", normalization="global")
    with pytest.raises(ConfigError, match=reason):
        apply_config(parse_config(mitigation), saved, RoutingConfig())


def test_named_mitigations_map_onto_verls_mechanisms() -> None:
    saved = LossConfig(convention="verl", normalization="global")
    applied = apply_config(parse_config({"mismatch_token_clip_max": 2, "log_ratio_clip": 5}), saved, RoutingConfig())
    assert applied.loss.convention == "verl" and applied.loss.mismatch_token_clip_max == 2.0
    lp, batch, _ = _batch(0.0)
    counts = GlobalCounts(2, 2 * float(batch["loss_mask"].sum()), 8)
    out = policy_loss(lp, batch, applied.loss, counts=counts)
    assert out.metrics["mean_weight"] != 1.0  # the token-level truncated IS weights are applied
