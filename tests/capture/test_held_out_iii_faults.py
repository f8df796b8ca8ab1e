"""The third held-out fault set (`capture.fault_injection.held_out_iii_faults`): each fault changes its part of a
real tiny_moe rank's step as the bug it names would, on its rank only, and its matrix cases use kinds no preset and
no earlier held-out case uses."""

from __future__ import annotations

import torch
from fault_steps import step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import StepParts, apply_faults, make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer
from axrl_spike_replay.models.param_groups import family_of
from axrl_spike_replay.models.tiny_moe import token_logprobs
from axrl_spike_replay.training.routing_replay import routing_control


def logits_of(t: RankTrainer, model: torch.nn.Module, parts: StepParts) -> torch.Tensor:
    with torch.no_grad():
        return model(parts.batch["tokens"], routing_control(t.spec.routing, parts.batch, parts.routed_experts)).logits


def test_a_vocab_shard_reference_normalises_over_its_shard_and_zeroes_the_other_targets() -> None:
    t = trainer(preset="peaked_kl")
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("ref_logprobs_vocab_shard", ranks=(1,), params={"shards": 2}))], parts)
    logits = logits_of(t, t.ref_model, parts).float()
    half = logits.shape[-1] // 2
    tokens = parts.batch["tokens"]
    b, p = 0, t.train.prompt_len + 1  # a response position
    lse = logits[b, p - 1, :half].logsumexp(-1)
    target = logits[b, p - 1, tokens[b, p]] if int(tokens[b, p]) < half else torch.tensor(0.0)
    assert torch.allclose(parts.batch["ref_logprobs"][b, p], target - lse, atol=1e-5)
    assert torch.equal(
        parts.batch["ref_logprobs"][:, : t.train.prompt_len], clean["ref_logprobs"][:, : t.train.prompt_len]
    )
    assert torch.equal(parts.batch["old_logprobs"], clean["old_logprobs"])
    spared, clean0 = step_parts(trainer(rank=0, preset="peaked_kl"), "batch")
    apply_faults([make_fault(FaultSpec("ref_logprobs_vocab_shard", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["ref_logprobs"], clean0["ref_logprobs"])


def test_old_logprobs_normalised_over_positions_take_the_softmax_along_the_sequence() -> None:
    t = trainer()
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("old_logprobs_softmax_over_positions"))], parts)
    logits = logits_of(t, t.model, parts).float()
    tokens = parts.batch["tokens"]
    b, p = 1, t.train.prompt_len + 2
    expected = logits[b, p - 1, tokens[b, p]] - logits[b, :, tokens[b, p]].logsumexp(0)
    assert torch.allclose(parts.batch["old_logprobs"][b, p], expected, atol=1e-4)
    assert not torch.allclose(parts.batch["old_logprobs"][b, p], clean["old_logprobs"][b, p], atol=1e-2)
    prompt = slice(0, t.train.prompt_len)
    assert torch.equal(parts.batch["old_logprobs"][:, prompt], clean["old_logprobs"][:, prompt])


def test_a_repetition_penalty_lowers_only_the_repeated_tokens_reported_logprob() -> None:
    t = trainer()
    parts, clean = step_parts(t, "rollout")
    apply_faults([make_fault(FaultSpec("rollout_logprobs_repetition_penalty", params={"penalty": 3.0}))], parts)
    logits = logits_of(t, t.model, parts).float()
    tokens = parts.batch["tokens"]
    own = token_logprobs(logits, tokens)
    reported = parts.batch["rollout_logprobs"]
    first = [
        (b, p)
        for b in range(tokens.shape[0])
        for p in range(t.train.prompt_len, tokens.shape[1])
        if int(tokens[b, p]) not in tokens[b, :p].tolist()
    ]
    repeated = [
        (b, p)
        for b in range(tokens.shape[0])
        for p in range(t.train.prompt_len, tokens.shape[1])
        if int(tokens[b, p]) in tokens[b, :p].tolist() and float(logits[b, p - 1, tokens[b, p]]) > 0
    ]
    assert repeated and first
    # a token not seen before gains mass from the penalised ones; a repeated, likely one loses it
    assert all(float(reported[b, p]) >= float(own[b, p]) - 1e-4 for b, p in first)
    assert sum(float(reported[b, p]) < float(own[b, p]) - 1e-3 for b, p in repeated) > len(repeated) // 2
    assert torch.equal(reported[:, : t.train.prompt_len], clean["rollout_logprobs"][:, : t.train.prompt_len])


def test_reversed_layer_routes_swap_the_two_moe_layers() -> None:
    parts, _ = step_parts(trainer(), "rollout")
    before = parts.routed_experts
    assert before is not None and before.shape[2] == 2
    apply_faults([make_fault(FaultSpec("routes_layers_reversed", ranks=(1,)))], parts)
    after = parts.routed_experts
    assert after is not None
    assert torch.equal(after[:, :, 0], before[:, :, 1]) and torch.equal(after[:, :, 1], before[:, :, 0])


def test_a_stop_tail_pads_the_response_and_leaves_the_mask_over_it() -> None:
    t = trainer()
    parts, clean = step_parts(t, "rollout")
    apply_faults([make_fault(FaultSpec("stop_tail_in_mask", params={"keep": 2, "pad": 5}))], parts)
    cut = t.train.prompt_len + 2
    assert parts.batch["tokens"][:, cut:].eq(5).all()
    assert torch.equal(parts.batch["tokens"][:, :cut], clean["tokens"][:, :cut])
    assert torch.equal(parts.batch["loss_mask"], clean["loss_mask"])
    assert parts.batch["rollout_logprobs"][:, cut:].eq(0).all()
    routes = parts.routed_experts
    assert routes is not None and routes[:, cut:].eq(-1).all()
    assert torch.equal(routes[:, :cut], step_parts(t, "rollout")[0].routed_experts[:, :cut])  # type: ignore[index]


def test_a_log_reward_is_minus_infinity_where_the_score_is_zero() -> None:
    parts, clean = step_parts(trainer(), "rewards")
    apply_faults([make_fault(FaultSpec("reward_log_of_zero"))], parts)
    zero = clean["rewards"] == 0
    assert zero.any() and torch.isneginf(parts.batch["rewards"][zero]).all()
    assert torch.allclose(parts.batch["rewards"][~zero], clean["rewards"][~zero].log())


def test_one_experts_gradients_accumulate_times_over_in_every_layer() -> None:
    t = trainer()
    parts, _ = step_parts(t, "gradients")
    for p in t.model.parameters():
        p.grad = torch.ones_like(p)
    apply_faults([make_fault(FaultSpec("expert_grad_accumulated", params={"expert": 1, "times": 4.0}))], parts)
    experts = {n: p for n, p in t.model.named_parameters() if family_of(n) == "experts"}
    assert len(experts) >= 2  # tiny_moe's experts are fused [E, ...] tensors, one pair per MoE layer
    for name, p in t.model.named_parameters():
        assert p.grad is not None
        if name in experts:
            assert torch.all(p.grad[1] == 4) and torch.all(p.grad[0] == 1) and torch.all(p.grad[2:] == 1), name
        else:
            assert torch.all(p.grad == 1), name


def test_grads_never_zeroed_carry_every_earlier_steps_gradient_into_the_burst() -> None:
    t = trainer()
    fault = make_fault(FaultSpec("grads_not_zeroed", params={"family": "router"}))
    parts, _ = step_parts(t, "gradients")
    for step, value in ((1, 1.0), (2, 2.0), (3, 4.0)):
        for p in t.model.parameters():
            p.grad = torch.full_like(p, value)
        parts.iteration, parts.in_burst = step, step == 3
        apply_faults([fault], parts)
    for name, p in t.model.named_parameters():
        assert p.grad is not None
        expected = 7.0 if family_of(name) == "router" else 4.0  # 4 + the carried 1 + 2
        assert torch.all(p.grad == expected), name
