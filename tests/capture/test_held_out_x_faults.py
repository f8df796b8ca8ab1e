"""The tenth held-out fault set (`capture.fault_injection.held_out_x_faults`): each fault changes its part of a real
tiny_moe rank's step as the bug it names would, on its rank only, and its matrix cases use kinds no preset and no
earlier held-out case uses."""

from __future__ import annotations

import pytest
import torch
from fault_steps import backward_gradients, gradients, step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import apply_faults, make_fault
from axrl_spike_replay.capture.fault_injection.held_out_x_faults import (
    context_parallel_order,
    context_parallel_unrestored,
    expert_weights,
    input_embedding,
    reversed_response,
    router_scores,
    shard_swapped_ids,
)
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.rollout import rollout_engine
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.rank_step import rank_forward_backward
from axrl_spike_replay.training.routing_replay import routing_control

Batch = dict[str, torch.Tensor]


def test_a_context_parallel_gather_never_reordered_hands_positions_the_log_probs_of_other_chunks() -> None:
    # 14 positions padded to 16, four chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert context_parallel_order(14, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9]
    assert context_parallel_unrestored(torch.arange(1.0, 7.0)[None], 2).tolist() == [[1.0, 2.0, 0.0, 0.0, 3.0, 4.0]]
    t = trainer()
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("old_logprobs_context_parallel_unrestored", ranks=(1,)))], parts)
    got, own = parts.batch["old_logprobs"], clean["old_logprobs"]
    assert torch.equal(got[:, 8:12], own[:, 4:8]) and torch.equal(got[:, 4:6], own[:, 12:14])
    assert bool((got[:, 6:8] == 0).all()), "the split's padding"
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean if k != "old_logprobs")
    spared, clean0 = step_parts(trainer(rank=0), "batch")
    apply_faults([make_fault(FaultSpec("old_logprobs_context_parallel_unrestored", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["old_logprobs"], clean0["old_logprobs"])
    with pytest.raises(ConfigError, match="cp"):
        make_fault(FaultSpec("old_logprobs_context_parallel_unrestored", params={"cp": 1}))


def test_an_ascending_sort_records_each_tokens_lowest_scored_experts() -> None:
    t = trainer(preset="expert_sensitive")
    parts, _ = step_parts(t, "rollout")
    recorded = parts.routed_experts
    assert recorded is not None
    scores = router_scores(t.model, parts.batch)
    apply_faults([make_fault(FaultSpec("routes_topk_ascending", ranks=(1,)))], parts)
    got = parts.routed_experts
    assert got is not None and got.shape == recorded.shape and got.dtype == recorded.dtype
    k = recorded.shape[-1]
    lowest = scores.topk(k, dim=-1, largest=False).values.sort(dim=-1).values
    assert torch.allclose(scores.gather(-1, got.long()).sort(dim=-1).values, lowest)
    own = scores.topk(k, dim=-1).indices
    assert not bool((got.long()[..., :, None] == own[..., None, :]).any()), "none of the token's own top-k"
    assert not torch.equal(got, recorded)


def test_engine_log_probs_collected_back_to_front_reverse_each_response_and_keep_the_tokens() -> None:
    assert reversed_response(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]), 2).tolist() == [[1.0, 2.0, 5.0, 4.0, 3.0]]
    t = trainer(preset="peaked_rollout_ratio")
    parts, clean = step_parts(t, "rollout")
    apply_faults([make_fault(FaultSpec("rollout_logprobs_reversed", ranks=(1,)))], parts)
    p = t.train.prompt_len
    got, own = parts.batch["rollout_logprobs"], clean["rollout_logprobs"]
    assert torch.equal(got[:, p:], own[:, p:].flip(1)) and torch.equal(got[:, :p], own[:, :p])
    assert not torch.equal(got, own)
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean if k != "rollout_logprobs")


def test_engine_log_probs_gathered_one_vocabulary_shard_on_score_each_token_half_a_vocabulary_away() -> None:
    assert shard_swapped_ids(torch.tensor([[0, 3, 8, 15]]), 16, 2).tolist() == [[8, 11, 0, 7]]
    assert shard_swapped_ids(torch.tensor([[0, 15]]), 16, 4).tolist() == [[4, 3]]
    t = trainer(preset="peaked_rollout_ratio")
    parts, clean = step_parts(t, "rollout")
    apply_faults([make_fault(FaultSpec("rollout_logprobs_tp_shard_swapped", ranks=(1,)))], parts)
    p, tokens, own = t.train.prompt_len, clean["tokens"], clean["rollout_logprobs"]
    with torch.no_grad():
        logits = rollout_engine(t.model)(tokens).logits.float()[:, p - 1 : -1]
    assert torch.allclose(logits.log_softmax(-1).gather(-1, tokens[:, p:, None]).squeeze(-1), own[:, p:]), "its engine"
    swapped = logits.log_softmax(-1).gather(-1, (tokens[:, p:, None] + 8) % 16).squeeze(-1)
    got = parts.batch["rollout_logprobs"]
    assert torch.allclose(got[:, p:], swapped) and torch.equal(got[:, :p], own[:, :p])
    assert float(got[:, p:].mean()) < float(own[:, p:].mean()), "the sampled tokens are the likelier ones"
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean if k != "rollout_logprobs")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[n], b[n], atol=1e-6, rtol=1e-4) for n in a)


def test_a_training_forward_with_an_embedding_multiplier_gives_the_gradients_of_scaled_embeddings() -> None:
    t = trainer()
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    routes = parts.routed_experts
    assert routes is not None
    right = backward_gradients(t, clean, routes, t.spec.loss)
    apply_faults(
        [make_fault(FaultSpec("train_forward_embedding_multiplier", ranks=(1,), params={"multiplier": 4.0}))], parts
    )
    planted = gradients(t)
    table = getattr(input_embedding(t.model), "weight")  # noqa: B009 - the embedding's table
    with torch.no_grad():
        table.mul_(4.0)
    scaled = backward_gradients(
        t, clean, routes, t.spec.loss
    )  # the same forward: a lookup scaled is the scaled table's
    with torch.no_grad():
        table.div_(4.0)
    scaled["embed.weight"] = scaled["embed.weight"] * 4.0  # d(4 W)/dW
    assert _close(planted, scaled) and not _close(planted, right)
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean), "the batch is stored as the rollout made it"
    assert _close(backward_gradients(t, clean, routes, t.spec.loss), right), (
        "the scale is gone after the rank's backward"
    )


def test_an_expert_index_one_on_runs_each_routed_expert_with_the_next_experts_weights() -> None:
    t = trainer(preset="expert_sensitive")
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    routes = parts.routed_experts
    assert routes is not None
    names = {n for n, p in t.model.named_parameters() if any(p is w for w in expert_weights(t.model))}
    assert names and all(n.endswith(("ffn.w_in", "ffn.w_out")) for n in names)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    right = backward_gradients(t, clean, routes, t.spec.loss)
    apply_faults([make_fault(FaultSpec("expert_local_index_off_by_one", ranks=(1,)))], parts)
    planted = gradients(t)
    assert all(torch.equal(p, before[n]) for n, p in t.model.named_parameters()), "the weights are put back"
    twin = t.copy_policy(t.model)  # a policy whose expert slots hold the next expert's weights
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if n in names:
                p.copy_(p.roll(-1, dims=0))
    twin.zero_grad(set_to_none=True)
    rank_forward_backward(twin, clean, t.spec.loss, routing_control(t.spec.routing, clean, routes))
    wrong = {
        n: p.grad.roll(1, dims=0) if n in names else p.grad for n, p in twin.named_parameters() if p.grad is not None
    }
    assert wrong.keys() == planted.keys() and _close(planted, wrong)
    assert not _close(planted, right)
    backward_gradients(t, clean, routes, t.spec.loss)
    full_turn = make_fault(FaultSpec("expert_local_index_off_by_one", ranks=(1,), params={"offset": 4}))
    apply_faults([full_turn], parts)
    assert _close(gradients(t), right), "an offset of the expert count maps every expert onto itself"
