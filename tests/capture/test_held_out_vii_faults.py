"""The seventh held-out fault set (`capture.fault_injection.held_out_vii_faults`): each fault changes its part of a
real tiny_moe rank's step as the bug it names would, on its rank only, and its matrix cases use kinds no preset and
no earlier held-out case uses."""

from __future__ import annotations

import dataclasses
import math

import torch
from fault_steps import backward_gradients, gradients, step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import apply_faults, make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer
from axrl_spike_replay.training.rank_step import global_grad_norm
from axrl_spike_replay.training.routing_replay import routing_control

Batch = dict[str, torch.Tensor]


def _aligned(model: torch.nn.Module, t: RankTrainer, clean: Batch, routes: torch.Tensor | None) -> torch.Tensor:
    """[B, T, V] `model`'s log-probs aligned with the tokens they score (position 0 unused)."""
    with torch.no_grad():
        out = model(clean["tokens"], routing_control(t.spec.routing, clean, routes))
    return torch.nn.functional.pad(out.logits.float()[:, :-1].log_softmax(-1), (0, 0, 1, 0))


def test_last_position_and_unshifted_old_logprobs_replace_the_response_old_logprobs_on_the_hit_rank() -> None:
    for kind in ("old_logprobs_last_position_logits", "old_logprobs_labels_not_shifted"):
        t = trainer()
        parts, clean = step_parts(t, "batch")
        with torch.no_grad():
            logits = t.model(clean["tokens"], routing_control(t.spec.routing, clean, parts.routed_experts)).logits
        logp = _aligned(t.model, t, clean, parts.routed_experts)
        tokens = clean["tokens"].long()
        apply_faults([make_fault(FaultSpec(kind, ranks=(1,)))], parts)
        p = t.train.prompt_len
        own = logp.gather(-1, tokens[..., None]).squeeze(-1)
        if kind == "old_logprobs_last_position_logits":
            last = logits.float()[:, -1].log_softmax(-1)  # the distribution after the whole sequence
            wrong = torch.stack([last[b, tokens[b]] for b in range(tokens.shape[0])])
        else:
            wrong = logp[:, 1:].gather(-1, tokens[:, :-1, None]).squeeze(-1)
            wrong = torch.cat([own[:, :1], wrong], dim=1)
        assert torch.allclose(parts.batch["old_logprobs"][:, p:], wrong[:, p:], atol=1e-5), kind
        assert torch.equal(parts.batch["old_logprobs"][:, :p], clean["old_logprobs"][:, :p])
        assert torch.allclose(clean["old_logprobs"][:, p:], own[:, p:], atol=1e-5)  # what was stored before
        assert float((clean["old_logprobs"][:, p:] - wrong[:, p:]).abs().max()) > 0.5, kind
        spared, clean0 = step_parts(trainer(rank=0), "batch")
        apply_faults([make_fault(FaultSpec(kind, ranks=(1,)))], spared)
        assert torch.equal(spared.batch["old_logprobs"], clean0["old_logprobs"]), kind


def test_reference_logprobs_without_the_final_norm_are_the_logprobs_of_the_unnormalised_hidden_states() -> None:
    t = trainer(preset="peaked_kl")
    parts, clean = step_parts(t, "batch")
    norm = t.ref_model.norm
    t.ref_model.norm = torch.nn.Identity()
    try:
        logp = _aligned(t.ref_model, t, clean, parts.routed_experts)
    finally:
        t.ref_model.norm = norm
    apply_faults([make_fault(FaultSpec("ref_logprobs_final_norm_skipped", ranks=(1,)))], parts)
    p = t.train.prompt_len
    wrong = logp.gather(-1, clean["tokens"].long()[..., None]).squeeze(-1)
    assert torch.allclose(parts.batch["ref_logprobs"][:, p:], wrong[:, p:], atol=1e-5)
    assert torch.equal(parts.batch["ref_logprobs"][:, :p], clean["ref_logprobs"][:, :p])
    assert not torch.allclose(clean["ref_logprobs"][:, p:], wrong[:, p:], atol=1e-2)
    assert isinstance(t.ref_model.norm, torch.nn.LayerNorm) and not t.ref_model.norm._forward_hooks  # hook removed


def test_a_baseline_of_the_all_reduced_reward_sum_pushes_every_advantage_of_the_hit_rank_below_zero() -> None:
    t = trainer(preset="reinforce_baseline")
    parts, _ = step_parts(t, "advantages")
    rewards = torch.tensor([0.5, 0.25, 0.75, 1.0, 0.0, 0.125, 0.5, 0.875])
    parts.batch["rewards"] = rewards
    apply_faults([make_fault(FaultSpec("baseline_all_reduced_sum", ranks=(1,)))], parts)
    assert torch.allclose(parts.batch["advantages"], rewards - float(rewards.sum()))  # one process: its sum
    assert float(parts.batch["advantages"].max()) < -2.0
    spared, clean0 = step_parts(trainer(rank=0, preset="reinforce_baseline"), "advantages")
    apply_faults([make_fault(FaultSpec("baseline_all_reduced_sum", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["advantages"], clean0["advantages"])
    outside, _ = step_parts(t, "advantages")
    outside.in_burst = False
    before = outside.batch["advantages"].clone()
    apply_faults([make_fault(FaultSpec("baseline_all_reduced_sum", ranks=(1,)))], outside)
    assert torch.equal(outside.batch["advantages"], before), "outside the burst: the run's own advantages"


def test_a_slot_major_routing_buffer_viewed_layer_major_mixes_layers_and_slots() -> None:
    parts, _ = step_parts(trainer(preset="expert_sensitive"), "rollout")
    routes = parts.routed_experts
    assert routes is not None and routes.shape[2] >= 2 and routes.shape[3] >= 2
    layers, k = routes.shape[2:]
    apply_faults([make_fault(FaultSpec("routes_topk_layer_axes_swapped", samples=(0, 1)))], parts)
    after = parts.routed_experts
    assert after is not None and after.shape == routes.shape
    for b in (0, 1):
        for j in range(routes.shape[1]):
            buffer = routes[b, j].transpose(0, 1).reshape(-1)  # the engine's buffer, slot-major
            assert torch.equal(after[b, j], buffer.view(layers, k))
    assert torch.equal(after[2:], routes[2:]) and not torch.equal(after[:2], routes[:2])


def test_token_weights_as_the_loss_mask_multiply_the_rank_gradient_by_the_response_length() -> None:
    t = trainer()
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("loss_mask_as_token_weights", ranks=(1,)))], parts)
    mask = parts.batch["loss_mask"]
    assert torch.equal(mask > 0, clean["loss_mask"] > 0)
    assert torch.allclose(mask.sum(-1), torch.ones(mask.shape[0]))
    assert bool(((mask > 0) & (mask < 1)).any()), "values no 0/1 mask holds"
    routes = parts.routed_experts
    assert routes is not None
    policy_only = dataclasses.replace(t.spec.loss, aux_loss_coef=0.0, z_loss_coef=0.0)  # the router losses: no mask
    right, wrong = (
        backward_gradients(t, clean, routes, policy_only),
        backward_gradients(t, parts.batch, routes, policy_only),
    )
    length = float(clean["loss_mask"].sum(-1)[0])
    assert length > 1 and all(torch.allclose(wrong[n], length * right[n], rtol=1e-4, atol=1e-6) for n in right)


def test_an_uncapped_local_clip_scales_the_rank_gradient_up_to_max_norm_in_the_same_direction() -> None:
    t = trainer()
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    assert parts.routed_experts is not None
    right = backward_gradients(t, clean, parts.routed_experts)
    norm = global_grad_norm(t.model)
    apply_faults([make_fault(FaultSpec("local_clip_coef_uncapped", ranks=(1,), params={"max_norm": 30.0}))], parts)
    assert math.isclose(global_grad_norm(t.model), 30.0, rel_tol=1e-4) and norm < 30.0
    scaled = gradients(t)
    assert all(torch.allclose(scaled[n], right[n] * (30.0 / (norm + 1e-6)), rtol=1e-4, atol=1e-8) for n in right)


def test_a_replay_of_the_first_expert_only_gives_the_gradients_of_those_routes_and_stores_the_payload() -> None:
    t = trainer(preset="expert_sensitive")
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    routes = parts.routed_experts
    assert routes is not None
    stored = routes.clone()
    right = backward_gradients(t, clean, routes)
    apply_faults([make_fault(FaultSpec("replay_first_expert_only", ranks=(1,)))], parts)
    planted = gradients(t)
    wrong = backward_gradients(t, clean, routes[..., :1].expand_as(routes).contiguous())
    assert all(torch.allclose(planted[n], wrong[n], atol=1e-6, rtol=1e-5) for n in wrong)
    assert not all(torch.allclose(planted[n], right[n], atol=1e-6, rtol=1e-5) for n in right)
    assert parts.routed_experts is not None and torch.equal(parts.routed_experts, stored), "stored as recorded"
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean)
