"""The sixth held-out fault set (`capture.fault_injection.held_out_vi_faults`): each fault changes its part of a
real tiny_moe rank's step as the bug it names would, on its rank only, and its matrix cases use kinds no preset and
no earlier held-out case uses."""

from __future__ import annotations

import torch
from fault_steps import backward_gradients, gradients, step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import apply_faults, make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer
from axrl_spike_replay.training.routing_replay import routing_control

Batch = dict[str, torch.Tensor]


def planted(kind: str, stage: str, preset: str = "peaked", rank: int = 1) -> tuple[RankTrainer, Batch, Batch]:
    """Rank `rank`'s burst-step batch at `stage` with `kind` planted on rank 1, and the clean batch."""
    t = trainer(rank=rank, preset=preset)
    parts, clean = step_parts(t, stage)
    parts.loss = t.spec.loss
    apply_faults([make_fault(FaultSpec(kind, ranks=(1,)))], parts)
    return t, parts.batch, clean


def test_advantages_without_the_mean_are_the_rewards_over_the_group_std() -> None:
    t = trainer()
    parts, _ = step_parts(t, "advantages")
    parts.loss = t.spec.loss
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.625, 0.0, 0.25, 0.5, 1.0] * (parts.batch["rewards"].numel() // 8))
    parts.batch["rewards"] = rewards
    apply_faults([make_fault(FaultSpec("advantage_mean_not_subtracted"))], parts)
    groups = rewards.view(-1, t.train.group_size)
    expected = (groups / (groups.std(-1, keepdim=True, unbiased=False) + 1e-6)).reshape(-1)
    assert torch.allclose(parts.batch["advantages"], expected, rtol=1e-4)
    assert float(parts.batch["advantages"][:4].min()) > 8.0  # close rewards over a small std: far past the others


def test_old_logprobs_of_the_sequence_sum_hold_its_masked_sum_at_every_position() -> None:
    _, batch, clean = planted("old_logprobs_sequence_sum", "batch")
    mask = clean["loss_mask"].float()
    total = (clean["old_logprobs"] * mask).sum(-1, keepdim=True)
    assert torch.allclose(batch["old_logprobs"], total.expand_as(mask)) and bool(total.isfinite().all())
    _, spared, clean0 = planted("old_logprobs_sequence_sum", "batch", rank=0)
    assert torch.equal(spared["old_logprobs"], clean0["old_logprobs"])


def _ref_logits(t: RankTrainer, clean: Batch, routes: torch.Tensor | None) -> torch.Tensor:
    """[B, T, V] the reference's log-probs aligned with the tokens they score (position 0 unused)."""
    with torch.no_grad():
        out = t.ref_model(clean["tokens"], routing_control(t.spec.routing, clean, routes))
    return torch.nn.functional.pad(out.logits.float()[:, :-1].log_softmax(-1), (0, 0, 1, 0))


def test_reference_entropies_and_greedy_logprobs_replace_the_response_reference_logprobs() -> None:
    for kind in ("ref_logprobs_are_entropy", "ref_logprobs_of_argmax"):
        t = trainer(preset="peaked_kl")
        parts, clean = step_parts(t, "batch")
        logp = _ref_logits(t, clean, parts.routed_experts)
        apply_faults([make_fault(FaultSpec(kind, ranks=(1,)))], parts)
        p = t.train.prompt_len
        wrong = -(logp.exp() * logp).sum(-1) if kind == "ref_logprobs_are_entropy" else logp.max(-1).values
        assert torch.allclose(parts.batch["ref_logprobs"][:, p:], wrong[:, p:], atol=1e-5), kind
        assert torch.equal(parts.batch["ref_logprobs"][:, :p], clean["ref_logprobs"][:, :p])
        # the stored values were the sampled tokens' log-probs: not what the bug writes
        assert not torch.allclose(clean["ref_logprobs"][:, p:], wrong[:, p:], atol=1e-3)


def test_engine_logprobs_of_the_first_sequence_are_reported_for_every_sequence() -> None:
    t = trainer()
    parts, clean = step_parts(t, "rollout")
    apply_faults([make_fault(FaultSpec("rollout_logprobs_first_sequence", ranks=(1,)))], parts)
    p = t.train.prompt_len
    lp = clean["rollout_logprobs"]
    assert torch.equal(parts.batch["rollout_logprobs"][:, p:], lp[:1, p:].expand_as(lp[:, p:]))
    assert torch.equal(parts.batch["rollout_logprobs"][:, :p], lp[:, :p])
    assert not torch.equal(lp[1:, p:], lp[:1, p:].expand_as(lp[1:, p:]))


def test_a_token_major_routing_buffer_viewed_sample_major_gives_positions_other_tokens_routes() -> None:
    parts, _ = step_parts(trainer(), "rollout")
    routes = parts.routed_experts
    assert routes is not None
    b, n = routes.shape[:2]
    apply_faults([make_fault(FaultSpec("routes_token_major_view"))], parts)
    after = parts.routed_experts
    assert after is not None and after.shape == routes.shape
    flat = routes.transpose(0, 1).reshape(b * n, *routes.shape[2:])  # the engine's buffer, token-major
    assert all(torch.equal(after[i, j], flat[i * n + j]) for i in range(b) for j in range(n))
    assert not torch.equal(after, routes)


def test_routes_layer_off_by_one_fill_each_slot_with_the_next_moe_layers_routes() -> None:
    parts, _ = step_parts(trainer(), "rollout")
    routes = parts.routed_experts
    assert routes is not None and routes.shape[2] >= 2
    apply_faults([make_fault(FaultSpec("routes_layer_off_by_one", samples=(0,)))], parts)
    after = parts.routed_experts
    assert after is not None
    last = routes.shape[2] - 1
    assert all(torch.equal(after[0, :, layer], routes[0, :, layer + 1]) for layer in range(last))
    assert torch.equal(after[0, :, last], routes[0, :, last]) and torch.equal(after[1:], routes[1:])


def test_a_replay_offset_by_a_micro_batch_gives_the_gradients_of_the_rolled_routes_and_stores_them_in_order() -> None:
    t = trainer(preset="expert_sensitive")
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    routes = parts.routed_experts
    assert routes is not None
    stored = routes.clone()

    def backward(payload: torch.Tensor) -> dict[str, torch.Tensor]:
        return backward_gradients(t, clean, payload)

    right = backward(routes)
    apply_faults([make_fault(FaultSpec("replay_routes_offset_by_micro_batch", ranks=(1,), params={"rows": 4}))], parts)
    planted_grads = gradients(t)
    wrong = backward(torch.roll(routes, shifts=-4, dims=0))
    assert all(torch.allclose(planted_grads[n], wrong[n], atol=1e-6, rtol=1e-5) for n in wrong)
    assert not all(torch.allclose(planted_grads[n], right[n], atol=1e-6, rtol=1e-5) for n in right)
    assert parts.routed_experts is not None and torch.equal(parts.routed_experts, stored), "stored in order"
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean)
