"""The ninth held-out fault set (`capture.fault_injection.held_out_ix_faults`): each fault changes its part of a real
tiny_moe rank's step as the bug it names would, on its rank only, and its matrix cases use kinds no preset and no
earlier held-out case uses."""

from __future__ import annotations

import torch
from fault_steps import backward_gradients, gradients, step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import apply_faults, make_fault
from axrl_spike_replay.capture.fault_injection.held_out_ix_faults import (
    double_bos,
    sample_major,
)
from axrl_spike_replay.capture.reference.presets import FaultSpec

Batch = dict[str, torch.Tensor]


def test_a_double_bos_repeats_the_first_token_and_moves_the_rest_one_position_on() -> None:
    tokens = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 3]])
    assert double_bos(tokens).tolist() == [[1, 1, 5, 6], [1, 1, 8, 9]]
    parts, clean = step_parts(trainer(), "batch")
    apply_faults([make_fault(FaultSpec("tokens_double_bos", ranks=(1,)))], parts)
    assert torch.equal(parts.batch["tokens"], double_bos(clean["tokens"]))
    assert not torch.equal(parts.batch["tokens"], clean["tokens"])
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean if k != "tokens"), "log-probs, masks: the rollout's"
    spared, clean0 = step_parts(trainer(rank=0), "batch")
    apply_faults([make_fault(FaultSpec("tokens_double_bos", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["tokens"], clean0["tokens"])


def test_a_per_token_length_penalty_takes_the_response_length_times_the_coefficient_off_each_reward() -> None:
    t = trainer(preset="reinforce_baseline")
    parts, clean = step_parts(t, "rewards")
    fault = make_fault(FaultSpec("reward_length_penalty_per_token", ranks=(1,), params={"coef": 0.5}))
    apply_faults([fault], parts)
    lengths = (clean["loss_mask"][:, t.train.prompt_len :] > 0).float().sum(-1)
    assert bool((lengths > 0).all())
    assert torch.allclose(parts.batch["rewards"].float(), clean["rewards"].float() - 0.5 * lengths)
    assert bool((parts.batch["rewards"] < 0).all()), "below the verifier's [0, 1] range"


def test_sample_major_outputs_hand_each_row_another_rows_engine_logprobs() -> None:
    assert sample_major(8, 4).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert sample_major(4, 4).tolist() == [0, 1, 2, 3], "one prompt: nothing moves"
    t = trainer(preset="peaked_rollout_ratio")
    parts, clean = step_parts(t, "rollout")
    apply_faults([make_fault(FaultSpec("rollout_logprobs_sample_major", ranks=(1,)))], parts)
    p, order = t.train.prompt_len, sample_major(8, int(t.train.group_size))
    got, own = parts.batch["rollout_logprobs"], clean["rollout_logprobs"]
    assert torch.equal(got[:, p:], own[order, p:]) and torch.equal(got[:, :p], own[:, :p])
    assert not torch.equal(got, own)
    assert torch.equal(parts.batch["tokens"], clean["tokens"]), "the tokens keep their order"


def test_a_loss_scale_never_removed_leaves_every_gradient_of_the_rank_scaled() -> None:
    t = trainer()
    parts, clean = step_parts(t, "gradients")
    routes = parts.routed_experts
    assert routes is not None
    right = backward_gradients(t, clean, routes, t.spec.loss)
    apply_faults([make_fault(FaultSpec("loss_scale_not_removed", ranks=(1,), params={"scale": 1024.0}))], parts)
    planted = gradients(t)
    assert any(float(g.abs().max()) > 0 for g in right.values())
    assert all(torch.allclose(planted[n], 1024.0 * right[n], rtol=1e-5, atol=1e-9) for n in right)
    backward_gradients(t, clean, routes, t.spec.loss)
    spared = make_fault(FaultSpec("loss_scale_not_removed", ranks=(0,)))
    apply_faults([spared], parts)
    assert all(torch.equal(g, right[n]) for n, g in gradients(t).items()), "another rank's fault: untouched"


def test_a_training_forward_with_a_double_bos_gives_the_gradients_of_the_shifted_tokens() -> None:
    t = trainer()
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    routes = parts.routed_experts
    assert routes is not None
    right = backward_gradients(t, clean, routes, t.spec.loss)
    apply_faults([make_fault(FaultSpec("train_forward_double_bos", ranks=(1,)))], parts)
    planted = gradients(t)
    wrong = backward_gradients(t, {**clean, "tokens": double_bos(clean["tokens"])}, routes, t.spec.loss)
    assert all(torch.allclose(planted[n], wrong[n], atol=1e-6, rtol=1e-4) for n in wrong)
    assert not all(torch.allclose(planted[n], right[n], atol=1e-6, rtol=1e-4) for n in right)
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean), "the batch is stored as the rollout made it"


def test_an_accumulation_divisor_off_by_one_scales_by_n_over_n_less_one_and_divides_one_by_zero() -> None:
    t = trainer()
    parts, clean = step_parts(t, "gradients")
    routes = parts.routed_experts
    assert routes is not None
    right = backward_gradients(t, clean, routes, t.spec.loss)
    apply_faults(
        [make_fault(FaultSpec("grad_accumulation_off_by_one", ranks=(1,), params={"micro_batches": 4}))], parts
    )
    planted = gradients(t)
    assert all(torch.allclose(planted[n], right[n] * 4 / 3, rtol=1e-5, atol=1e-9) for n in right)
    backward_gradients(t, clean, routes, t.spec.loss)
    apply_faults([make_fault(FaultSpec("grad_accumulation_off_by_one", ranks=(1,)))], parts)
    got = torch.cat([g.flatten() for g in gradients(t).values()])
    full = torch.cat([g.flatten() for g in right.values()])
    assert not bool(torch.isfinite(got).any()), "one micro-batch: a division by zero"
    assert bool(torch.isinf(got[full != 0]).all()) and bool(torch.isnan(got[full == 0]).all())
