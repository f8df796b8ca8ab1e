"""`advantage_outlier_mask` on ordinary GRPO batches masks nothing; a real outlier is still caught.

Ordinary: group-normalised advantages (A = (r - mean) / (std + eps) per prompt group) from binary or graded
rewards, in float32 with float noise on top; groups of 2 to 12 (a lone correct answer in a group of n gets
about sqrt(n - 1), the most an ordinary advantage reaches). Real: one sample's advantage multiplied by a broken
reward scale, far beyond anything group normalisation can give."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axrl_spike_replay.training.sample_masks import outlier_samples, outlier_z

THRESHOLD = 6.0  # above what a group of at most 12 can give an ordinary advantage (sqrt(11) + a median off 0)


@st.composite
def grpo_batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    groups = draw(st.integers(1, 6))
    size = draw(st.integers(2, 12))
    graded = draw(st.booleans())
    unbiased = draw(st.booleans())
    rewards = []
    for _ in range(groups):
        if graded:
            rewards.append(draw(st.lists(st.floats(0, 1, allow_nan=False, width=32), min_size=size, max_size=size)))
        else:
            rewards.append([float(x) for x in draw(st.lists(st.integers(0, 1), min_size=size, max_size=size))])
    r = torch.tensor(rewards, dtype=torch.float32)
    std = r.std(dim=1, unbiased=unbiased, keepdim=True)
    adv = (r - r.mean(dim=1, keepdim=True)) / (std + 1e-6)
    noise = torch.tensor(draw(st.lists(st.floats(-3e-5, 3e-5), min_size=groups * size, max_size=groups * size)))
    adv = adv.reshape(-1) + noise.float()
    tokens = draw(st.integers(1, 6))
    return {
        "advantages": adv[:, None].expand(-1, tokens).contiguous(),  # per token, as verl keeps them
        "loss_mask": torch.ones(groups * size, tokens),
        "group_index": torch.arange(groups).repeat_interleave(size),
    }


def test_a_lone_right_answer_beside_a_group_of_near_tied_rewards_is_not_an_outlier() -> None:
    """The property test's counterexample: group 0's rewards tie to within the normaliser's epsilon (advantages
    spread 0.05), group 1 is an ordinary group of four with one right answer (1.68)."""
    adv = torch.tensor([-0.0240, -0.0240, -0.0240, 0.0719, -0.7625, -0.7625, 1.6775, -0.1525])
    batch = {"advantages": adv[:, None], "loss_mask": torch.ones(8, 1), "group_index": torch.tensor([0] * 4 + [1] * 4)}
    for scope in ("batch", "group"):
        assert not outlier_samples(batch, THRESHOLD, scope).any()
    scaled = adv.clone()
    scaled[6] = 106.0  # a reward-scale bug's advantage is still found
    assert outlier_samples({**batch, "advantages": scaled[:, None]}, THRESHOLD, "batch").tolist() == [
        i == 6 for i in range(8)
    ]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=grpo_batches(), scope=st.sampled_from(["batch", "group"]))
def test_an_ordinary_grpo_batch_masks_nothing(batch: dict[str, torch.Tensor], scope: str) -> None:
    assert not outlier_samples(batch, THRESHOLD, scope).any()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=grpo_batches(), data=st.data(), scope=st.sampled_from(["batch", "group"]))
def test_a_sample_scaled_by_a_broken_reward_is_caught(batch: dict[str, torch.Tensor], data, scope: str) -> None:
    adv = batch["advantages"][:, 0]
    groups = int(batch["group_index"].max()) + 1
    size = adv.numel() // groups
    spread = [float(adv[g * size : (g + 1) * size].std(unbiased=False)) for g in range(groups)]
    target = data.draw(st.integers(0, adv.numel() - 1))
    others = [s for g, s in enumerate(spread) if g != target // size and s > 1e-3]
    # something to judge by: another group with a spread (or, judged within its own group, one of at least 3)
    if not others:
        return
    factor = data.draw(st.floats(50, 1000))
    scaled = batch["advantages"].clone()
    scaled[target] = factor * max(1.0, float(adv.abs().max()))
    flagged = outlier_samples({**batch, "advantages": scaled}, THRESHOLD, scope)
    if scope == "group" and size < 3:
        assert not flagged.any()  # a group of two has no median to judge by
        return
    assert flagged.tolist() == [i == target for i in range(adv.numel())]


def test_float_noise_between_tied_advantages_is_a_tie_not_a_spread() -> None:
    """Two advantages that differ by 2.8e-5 made the MAD 2.8e-5: ordinary samples got z of 18,000-55,000."""
    values = [0.5, 0.5 + 2.8e-5, 0.5, 0.5 - 1e-5, 0.5 + 2e-5, -1.0, 1.2, 0.5]
    assert max(outlier_z(values)) < 2.0


def test_a_two_valued_group_with_one_correct_answer_is_not_an_outlier() -> None:
    """torch.median's lower middle and the mean-absolute-deviation fallback gave the lone correct answer of a
    group of 16 a z of about 13, and every positive sample of a two-valued batch 8-17."""
    lone = [math.sqrt(15)] + [-1 / math.sqrt(15)] * 15
    assert max(outlier_z(lone)) == 0.0  # no spread but the one value: nothing to judge by
    two = [1.0] * 3 + [-0.6] * 5
    groups = [0] * 8
    assert max(outlier_z(two + two, groups + [1] * 8)) < 3.0


def test_the_rule_reads_in_robust_standard_deviations_within_the_batch_or_group() -> None:
    adv = torch.tensor([0.3, -0.2, 0.1, -0.1, 40.0, 0.0])
    batch = {"advantages": adv, "loss_mask": torch.ones(6, 4), "group_index": torch.tensor([0, 0, 0, 1, 1, 1])}
    z = outlier_z(adv.tolist())
    assert z[4] > 5 > max(z[:4])
    assert outlier_samples(batch, 5.0).tolist() == [False, False, False, False, True, False]
    assert outlier_samples(batch, 5.0, "group").tolist() == [False, False, False, False, True, False]
    assert not outlier_samples({**batch, "advantages": torch.zeros(6)}, 5.0).any()


def test_a_lone_correct_answer_beside_tied_groups_is_not_an_outlier() -> None:
    """Found by the property above: four tied groups (all rewards equal, advantages float noise) and one group of
    ten with a single correct answer. The batch's spread, diluted by the tied groups, gave that answer z 6.7."""
    lone = [-0.23] * 9 + [2.07]
    values = [1e-5 * (i % 3 - 1) for i in range(10)] + lone + [0.0] * 30
    groups = [g for g in range(5) for _ in range(10)]
    groups = groups[:10] + [1] * 10 + groups[20:]
    for scope in ("batch", "group"):
        assert max(outlier_z(values, groups, scope)) <= THRESHOLD
