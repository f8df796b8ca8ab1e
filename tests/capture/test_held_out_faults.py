"""The second held-out fault set (`capture.fault_injection.held_out_faults`): each fault changes its part of a real
tiny_moe rank's step, on its rank only, and its matrix cases use kinds no preset and no earlier held-out case uses."""

from __future__ import annotations

import torch
from fault_steps import step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import apply_faults, make_fault
from axrl_spike_replay.capture.fault_injection.held_out_faults import HELD_OUT_KINDS
from axrl_spike_replay.capture.reference.presets import PRESETS, FaultSpec
from axrl_spike_replay.testing.fault_matrix import matrix_cases


def test_the_second_held_out_set_uses_kinds_no_preset_and_no_earlier_held_out_case_uses() -> None:
    earlier = {s.kind for c in matrix_cases(("held_out", "unseen")) for s in c.faults}
    earlier |= {p.injected.kind for p in PRESETS.values() if p.injected is not None}
    cases = matrix_cases(("held_out_ii",))
    kinds = {s.kind for c in cases for s in c.faults}
    assert kinds.isdisjoint(earlier) and kinds <= set(HELD_OUT_KINDS) and len(kinds) >= 6
    assert len(cases) >= 6
    assert {c.model for c in cases} >= {"tiny_moe", "qwen2_moe"} and {c.world_size for c in cases} >= {2, 4}
    doubles = [c for c in cases if len(c.expected_ranks(c.world_size)) >= 2 and len(c.faults) >= 2]
    assert doubles, "one case plants two faults on two ranks"


def test_old_logprobs_at_temperature_sharpen_the_stored_old_logprobs_only() -> None:
    t = trainer()
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("old_logprobs_at_temperature", ranks=(1,), params={"temperature": 0.5}))], parts)
    resp = parts.batch["loss_mask"].bool()
    moved = (parts.batch["old_logprobs"] - clean["old_logprobs"])[resp].abs()
    assert float(moved.max()) > 0.1
    assert torch.equal(parts.batch["ref_logprobs"], clean["ref_logprobs"])
    spared, clean0 = step_parts(trainer(rank=0), "batch")
    apply_faults([make_fault(FaultSpec("old_logprobs_at_temperature", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["old_logprobs"], clean0["old_logprobs"])


def test_local_expert_ids_fold_every_route_into_the_first_shard() -> None:
    t = trainer()
    parts, _ = step_parts(t, "rollout")
    before = parts.routed_experts
    assert before is not None and int(before.max()) >= 2
    apply_faults([make_fault(FaultSpec("routes_local_expert_ids", params={"ep": 2}))], parts)
    after = parts.routed_experts
    assert after is not None and int(after.max()) < 2 and torch.equal(after, before % 2)


def test_an_advantage_std_over_a_singleton_axis_divides_by_the_epsilon() -> None:
    t = trainer()
    parts, clean = step_parts(t, "advantages")
    apply_faults([make_fault(FaultSpec("advantage_std_singleton_axis", params={"eps": 1e-3}))], parts)
    groups = clean["rewards"].view(-1, t.train.group_size)
    expected = ((groups - groups.mean(-1, keepdim=True)) / 1e-3).reshape(-1)
    assert torch.allclose(parts.batch["advantages"], expected)


def test_weight_decay_in_the_gradient_adds_the_scaled_weights() -> None:
    t = trainer()
    parts, _ = step_parts(t, "gradients")
    for p in t.model.parameters():
        p.grad = torch.zeros_like(p)
    apply_faults([make_fault(FaultSpec("weight_decay_in_grad", params={"weight_decay": 0.5}))], parts)
    for p in t.model.parameters():
        assert p.grad is not None and torch.allclose(p.grad, 0.5 * p.detach())


def test_a_stale_layer_shard_trains_on_the_initial_layer_and_puts_the_trained_one_back() -> None:
    t = trainer()
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.01)  # the trained weights differ from the initial (reference) copy
    trained = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    initial = {n: p.detach().clone() for n, p in t.ref_model.named_parameters()}
    fault = make_fault(FaultSpec("stale_layer_shard", params={"layers": [0]}))
    parts, _ = step_parts(t, "batch")
    apply_faults([fault], parts)
    swapped = {n for n, p in t.model.named_parameters() if torch.equal(p, initial[n])}
    assert swapped and all(".0." in n for n in swapped)
    assert all(torch.equal(p, trained[n]) for n, p in t.model.named_parameters() if n not in swapped)
    parts.stage = "gradients"
    apply_faults([fault], parts)
    assert all(torch.equal(p, trained[n]) for n, p in t.model.named_parameters())


def test_a_mask_over_the_prompt_takes_every_predicted_prompt_position() -> None:
    t = trainer()
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("mask_covers_prompt", ranks=(1,)))], parts)
    mask = parts.batch["loss_mask"]
    assert mask[:, 1 : t.train.prompt_len].eq(1).all() and mask[:, 0].eq(0).all()
    assert torch.equal(mask[:, t.train.prompt_len :], clean["loss_mask"][:, t.train.prompt_len :])
