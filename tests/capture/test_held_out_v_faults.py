"""The fifth held-out fault set (`capture.fault_injection.held_out_v_faults`): each fault changes its part of a
real tiny_moe rank's step as the bug it names would, on its rank only, and its matrix cases use kinds no preset and
no earlier held-out case uses."""

from __future__ import annotations

import torch
from fault_steps import backward_gradients, gradients, step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import apply_faults, make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer
from axrl_spike_replay.training.loss_config import LossConfig

ROUTES: dict[int, torch.Tensor | None] = {}  # each trainer's burst routes, by id


def backward(t: RankTrainer, batch: dict[str, torch.Tensor], loss: LossConfig | None = None) -> dict[str, torch.Tensor]:
    """The rank's gradients of its loss on `batch` (under `loss`, the run's by default)."""
    return backward_gradients(t, batch, ROUTES[id(t)], loss)


Batch = dict[str, torch.Tensor]


def planted(kind: str, preset: str = "peaked", rank: int = 1) -> tuple[RankTrainer, Batch, Batch]:
    """Rank `rank`'s burst-step gradients with `kind` planted on rank 1, and the batch it stores."""
    t = trainer(rank=rank, preset=preset)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.05)  # trained weights that differ from the reference's
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    ROUTES[id(t)] = parts.routed_experts
    backward(t, parts.batch)
    apply_faults([make_fault(FaultSpec(kind, ranks=(1,)))], parts)
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean), "the stored batch is the right one"
    return t, gradients(t), clean


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[n], b[n], atol=1e-6, rtol=1e-5) for n in a)


def test_a_ratio_against_the_reference_gives_the_gradients_of_the_loss_with_the_reference_as_old() -> None:
    t, grads, clean = planted("ratio_against_reference")
    wrong = {**clean, "old_logprobs": clean["ref_logprobs"]}
    assert close(grads, backward(t, wrong)) and not close(grads, backward(t, clean))
    spared, spared_grads, spared_clean = planted("ratio_against_reference", rank=0)
    assert close(spared_grads, backward(spared, spared_clean))


def test_a_loss_label_shift_pairs_each_new_logprob_with_the_old_one_before_it() -> None:
    t, grads, clean = planted("loss_label_shift")
    old = clean["old_logprobs"]
    wrong = {**clean, "old_logprobs": torch.cat([old[:, :1], old[:, :-1]], dim=1)}
    assert close(grads, backward(t, wrong)) and not close(grads, backward(t, clean))


def test_a_loss_with_no_mask_averages_over_every_position_the_batch_has_a_logprob_at() -> None:
    t, grads, clean = planted("loss_mask_not_applied")
    everywhere = torch.ones_like(clean["loss_mask"])
    everywhere[:, 0] = clean["loss_mask"][:, 0]
    assert close(grads, backward(t, {**clean, "loss_mask": everywhere})) and not close(grads, backward(t, clean))


def test_advantages_divided_by_the_variance_are_the_std_advantages_over_the_std() -> None:
    t = trainer()
    parts, _ = step_parts(t, "advantages")
    group = t.train.group_size
    rewards = torch.tensor([0.0, 0.25, 0.5, 1.0, 0.1, 0.2, 0.2, 0.3] * (parts.batch["rewards"].numel() // 8))
    parts.batch["rewards"] = rewards
    apply_faults([make_fault(FaultSpec("advantage_divided_by_variance"))], parts)
    groups = rewards.view(-1, group)
    std = groups.std(-1, keepdim=True, unbiased=False)
    expected = ((groups - groups.mean(-1, keepdim=True)) / std / std).reshape(-1)
    assert torch.allclose(parts.batch["advantages"], expected, rtol=1e-3)


def test_routes_of_the_previous_step_replace_the_hit_samples_routes() -> None:
    t = trainer()
    t.rollout(19)
    before = t.previous_routes
    parts, _ = step_parts(t, "rollout")
    t.previous_routes = before  # as the burst step's rollout stage sees it (step_parts ran the whole step)
    assert before is not None and parts.routed_experts is not None
    current = parts.routed_experts.clone()
    assert not torch.equal(before, current)
    apply_faults([make_fault(FaultSpec("routes_previous_step", samples=(1, 2)))], parts)
    after = parts.routed_experts
    assert torch.equal(after[1:3], before[1:3].to(after.dtype)) and torch.equal(after[3:], current[3:])


def test_routes_of_one_layer_broadcast_fill_every_moe_layer_with_the_first() -> None:
    parts, _ = step_parts(trainer(), "rollout")
    routes = parts.routed_experts
    assert routes is not None and routes.shape[2] >= 2 and not torch.equal(routes[:, :, 0], routes[:, :, 1])
    apply_faults([make_fault(FaultSpec("routes_one_layer_broadcast", samples=(0,)))], parts)
    after = parts.routed_experts
    assert after is not None
    assert all(torch.equal(after[0, :, layer], routes[0, :, 0]) for layer in range(routes.shape[2]))
    assert torch.equal(after[1:], routes[1:])


def test_engine_logprobs_of_the_previous_step_are_its_response_logprobs() -> None:
    t = trainer()
    t.rollout(19)
    previous = t.previous
    parts, clean = step_parts(t, "rollout")
    parts.previous = previous
    assert previous is not None
    apply_faults([make_fault(FaultSpec("rollout_logprobs_previous_step"))], parts)
    p = t.train.prompt_len
    assert torch.equal(parts.batch["rollout_logprobs"][:, p:], previous["rollout_logprobs"][:, p:])
    assert torch.equal(parts.batch["rollout_logprobs"][:, :p], clean["rollout_logprobs"][:, :p])


def test_reference_logprobs_that_are_nll_are_the_negated_response_logprobs() -> None:
    t = trainer(preset="peaked_kl")
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("ref_logprobs_are_nll", ranks=(1,)))], parts)
    p = t.train.prompt_len
    assert torch.equal(parts.batch["ref_logprobs"][:, p:], -clean["ref_logprobs"][:, p:])
    assert torch.equal(parts.batch["ref_logprobs"][:, :p], clean["ref_logprobs"][:, :p])
    spared, clean0 = step_parts(trainer(rank=0, preset="peaked_kl"), "batch")
    apply_faults([make_fault(FaultSpec("ref_logprobs_are_nll", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["ref_logprobs"], clean0["ref_logprobs"])
