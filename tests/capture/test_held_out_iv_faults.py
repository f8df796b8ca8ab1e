"""The fourth held-out fault set (`capture.fault_injection.held_out_iv_faults`): each fault changes its part of a
real tiny_moe rank's step as the bug it names would, on its rank only, and its matrix cases use kinds no preset and
no earlier held-out case uses."""

from __future__ import annotations

import math

import torch
from fault_steps import step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import apply_faults, make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.models.policy import policy_forward
from axrl_spike_replay.models.tiny_moe import token_logprobs
from axrl_spike_replay.training.routing_replay import routing_control


def test_unnormalised_reference_logprobs_are_the_raw_logits_of_the_response() -> None:
    t = trainer(preset="peaked_kl")
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("ref_logprobs_unnormalised", ranks=(1,)))], parts)
    with torch.no_grad():
        logits = t.ref_model(parts.batch["tokens"], routing_control(t.spec.routing, parts.batch, parts.routed_experts))
    tokens, p = parts.batch["tokens"], t.train.prompt_len + 1
    assert torch.allclose(parts.batch["ref_logprobs"][0, p], logits.logits[0, p - 1, tokens[0, p]].float(), atol=1e-5)
    prompt = slice(0, t.train.prompt_len)
    assert torch.equal(parts.batch["ref_logprobs"][:, prompt], clean["ref_logprobs"][:, prompt])
    spared, clean0 = step_parts(trainer(rank=0, preset="peaked_kl"), "batch")
    apply_faults([make_fault(FaultSpec("ref_logprobs_unnormalised", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["ref_logprobs"], clean0["ref_logprobs"])


def test_old_logprobs_with_the_adapter_disabled_are_the_references() -> None:
    t = trainer()
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.05)  # trained weights that differ from the reference's
    parts, clean = step_parts(t, "batch")
    assert not torch.allclose(clean["old_logprobs"], clean["ref_logprobs"])
    apply_faults([make_fault(FaultSpec("old_logprobs_adapter_disabled", samples=(0, 1)))], parts)
    assert torch.equal(parts.batch["old_logprobs"][:2], clean["ref_logprobs"][:2])
    assert torch.equal(parts.batch["old_logprobs"][2:], clean["old_logprobs"][2:])


def test_routes_read_before_the_copy_are_zeros_on_the_hit_samples_only() -> None:
    parts, _ = step_parts(trainer(), "rollout")
    before = parts.routed_experts
    assert before is not None and int(before.max()) > 0
    apply_faults([make_fault(FaultSpec("routes_read_before_copy", samples=(3,)))], parts)
    after = parts.routed_experts
    assert after is not None and after[3].eq(0).all()
    assert torch.equal(after[:3], before[:3]) and torch.equal(after[4:], before[4:])


def test_an_advantage_std_without_eps_is_nan_for_a_group_of_equal_rewards_only() -> None:
    t = trainer()
    parts, _ = step_parts(t, "advantages")
    group = t.train.group_size
    rewards = torch.tensor([0.5] * group + [0.0, 0.25, 0.5, 1.0] * (parts.batch["rewards"].numel() // group - 1))
    parts.batch["rewards"] = rewards
    apply_faults([make_fault(FaultSpec("advantage_std_without_eps"))], parts)
    advantages = parts.batch["advantages"]
    assert torch.isnan(advantages[:group]).all() and torch.isfinite(advantages[group:]).all()
    groups = rewards[group:].view(-1, group)
    expected = ((groups - groups.mean(-1, keepdim=True)) / groups.std(-1, keepdim=True, unbiased=False)).reshape(-1)
    assert torch.allclose(advantages[group:], expected)


def test_a_hot_engine_replica_samples_other_tokens_and_scores_them_at_temperature_one() -> None:
    t = trainer()
    parts, clean = step_parts(t, "rollout")
    parts.generator = torch.Generator().manual_seed(7)  # the step's seeded stream, as the trainer gives it
    apply_faults([make_fault(FaultSpec("engine_sampling_temperature", params={"temperature": 8.0}))], parts)
    tokens = parts.batch["tokens"]
    prompt = slice(0, t.train.prompt_len)
    assert torch.equal(tokens[:, prompt], clean["tokens"][:, prompt])
    assert not torch.equal(tokens, clean["tokens"])
    from axrl_spike_replay.capture.reference.rollout import rollout_engine

    with torch.no_grad():
        out = rollout_engine(t.model)(tokens)
    assert torch.allclose(parts.batch["rollout_logprobs"], token_logprobs(out.logits.float(), tokens).float())
    assert parts.routed_experts is not None and torch.equal(parts.routed_experts, out.routes.to(torch.int32))


def test_an_inverted_loss_mask_covers_the_prompt_and_leaves_out_the_response() -> None:
    t = trainer()
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("loss_mask_inverted", ranks=(1,)))], parts)
    assert torch.equal(parts.batch["loss_mask"], 1.0 - clean["loss_mask"])
    assert parts.batch["loss_mask"][:, t.train.prompt_len :].eq(0).all()


def test_base2_engine_logprobs_are_the_response_logprobs_over_ln2() -> None:
    t = trainer()
    parts, clean = step_parts(t, "rollout")
    apply_faults([make_fault(FaultSpec("rollout_logprobs_base2"))], parts)
    resp = slice(t.train.prompt_len, None)
    expected = clean["rollout_logprobs"][:, resp] / math.log(2.0)
    assert torch.allclose(parts.batch["rollout_logprobs"][:, resp], expected)
    prompt = slice(0, t.train.prompt_len)
    assert torch.equal(parts.batch["rollout_logprobs"][:, prompt], clean["rollout_logprobs"][:, prompt])


def test_advantages_summed_over_the_positions_are_the_sequence_length_times_the_advantage() -> None:
    t = trainer()
    parts, clean = step_parts(t, "advantages")
    apply_faults([make_fault(FaultSpec("advantages_summed_over_positions", samples=(0, 5)))], parts)
    length = parts.batch["tokens"].shape[1]
    out, before = parts.batch["advantages"], clean["advantages"]
    assert torch.allclose(out[[0, 5]], before[[0, 5]] * length)
    keep = [i for i in range(out.shape[0]) if i not in (0, 5)]
    assert torch.equal(out[keep], before[keep])


def test_a_summed_entropy_bonus_adds_its_gradient_to_the_ranks_own() -> None:
    t = trainer()
    parts, _ = step_parts(t, "gradients")
    for p in t.model.parameters():
        p.grad = torch.ones_like(p)  # the rank's own gradients, which the bonus adds to
    apply_faults([make_fault(FaultSpec("entropy_bonus_summed", params={"coef": 0.5}))], parts)
    added = {n: p.grad - 1.0 for n, p in t.model.named_parameters() if p.grad is not None}
    assert any(float(g.abs().max()) > 1e-4 for g in added.values())
    t.model.zero_grad(set_to_none=True)
    routing = routing_control(t.spec.routing, parts.batch, parts.routed_experts)
    out = policy_forward(t.model, parts.batch, routing, need_entropy=True)
    assert out.entropy is not None
    (-0.5 * (out.entropy * parts.batch["loss_mask"]).sum()).backward()
    for name, p in t.model.named_parameters():
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(added[name], expected, atol=1e-5), name
    spared, _ = step_parts(trainer(rank=0), "gradients")
    for p in spared.trainer.model.parameters():
        p.grad = torch.ones_like(p)
    apply_faults([make_fault(FaultSpec("entropy_bonus_summed", ranks=(1,)))], spared)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in spared.trainer.model.parameters())


def position_table(model: torch.nn.Module) -> torch.Tensor:
    table = getattr(model, "pos")  # noqa: B009 (tiny_moe's learned positions)
    assert isinstance(table, torch.nn.Embedding)
    return table.weight


def test_positions_not_reset_read_the_table_late_and_return_each_rows_gradient() -> None:
    t = trainer()
    table = position_table(t.model)
    trained = table.detach().clone()
    fault = make_fault(FaultSpec("positions_not_reset_after_packing", ranks=(1,), params={"offset": 3}))
    parts, _ = step_parts(t, "batch")
    apply_faults([fault], parts)
    assert torch.equal(table.detach()[:-3], trained[3:])
    seq = parts.batch["tokens"].shape[1]
    table.grad = torch.zeros_like(table)
    table.grad[:seq] = torch.arange(1, seq + 1, dtype=table.dtype)[:, None]
    parts.stage = "gradients"
    apply_faults([fault], parts)
    assert torch.equal(table.detach(), trained)
    assert table.grad[:3].eq(0).all() and torch.equal(table.grad[3 : 3 + seq, 0], torch.arange(1, seq + 1).float())
    spared, _ = step_parts(trainer(rank=0), "batch")
    before = position_table(spared.trainer.model).detach().clone()
    apply_faults([fault], spared)
    assert torch.equal(position_table(spared.trainer.model).detach(), before)
