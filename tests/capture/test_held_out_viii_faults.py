"""The eighth held-out fault set (`capture.fault_injection.held_out_viii_faults`): each fault changes its part of a
real tiny_moe rank's step as the bug it names would, on its rank only, and its matrix cases use kinds no preset and
no earlier held-out case uses."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from fault_steps import backward_gradients, gradients, step_parts, trainer

from axrl_spike_replay.capture.fault_injection.faults import StepParts, apply_faults, make_fault
from axrl_spike_replay.capture.fault_injection.held_out_viii_faults import (
    neighbour,
    split_groups,
)
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer
from axrl_spike_replay.models.tiny_moe import MoEFeedForward, TinyMoEPolicy
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.training.routing_replay import routing_control

Batch = dict[str, torch.Tensor]


def _aligned(model: torch.nn.Module, t: RankTrainer, batch: Batch, routes: torch.Tensor) -> torch.Tensor:
    """[B, T] `model`'s log-probs of `batch["tokens"]` routed with `routes` (position 0: 0)."""
    tokens = batch["tokens"]
    with torch.no_grad():
        logits = model(tokens, routing_control(t.spec.routing, batch, routes)).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None].long()).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def test_packed_old_logprobs_score_each_second_sequence_with_the_first_in_its_context() -> None:
    t = trainer()
    parts, clean = step_parts(t, "batch")
    routes = parts.routed_experts
    assert routes is not None
    length = clean["tokens"].shape[1]
    apply_faults([make_fault(FaultSpec("old_logprobs_packed_across_sequences", ranks=(1,)))], parts)
    p = t.train.prompt_len
    old = parts.batch["old_logprobs"]
    # the first sequence of each pack sees only itself: its old log-probs are the clean ones
    assert torch.allclose(old[0::2], clean["old_logprobs"][0::2], atol=1e-5)
    pair = {"tokens": clean["tokens"][2:4].reshape(1, 2 * length), "loss_mask": clean["loss_mask"][2:4].reshape(1, -1)}
    joined = _aligned(t.model, t, pair, routes[2:4].reshape(1, 2 * length, *routes.shape[2:]))
    assert torch.allclose(old[3, p:], joined[0, length + p :], atol=1e-5)  # the second: after the first
    assert torch.equal(old[:, :p], clean["old_logprobs"][:, :p])
    assert float((old[1::2, p:] - clean["old_logprobs"][1::2, p:]).abs().max()) > 0.5
    spared, clean0 = step_parts(trainer(rank=0), "batch")
    apply_faults([make_fault(FaultSpec("old_logprobs_packed_across_sequences", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["old_logprobs"], clean0["old_logprobs"])


def test_cumulative_engine_logprobs_are_the_running_sum_over_the_response() -> None:
    parts, clean = step_parts(trainer(preset="peaked_rollout_ratio"), "rollout")
    apply_faults([make_fault(FaultSpec("rollout_logprobs_cumulative", ranks=(1,)))], parts)
    p = parts.prompt_len
    got, own = parts.batch["rollout_logprobs"], clean["rollout_logprobs"]
    assert torch.allclose(got[:, p:], own[:, p:].cumsum(-1), atol=1e-5)
    assert torch.equal(got[:, :p], own[:, :p])
    assert torch.allclose(got[:, -1], own[:, p:].sum(-1), atol=1e-5) and bool((got[:, p:] <= own[:, p:]).all())


def test_a_gather_read_one_rank_on_hands_each_rank_the_next_ranks_payload() -> None:
    gathered = [torch.full((2, 3), float(r)) for r in range(4)]
    assert [float(neighbour(gathered, r)[0, 0]) for r in range(4)] == [1.0, 2.0, 3.0, 0.0]
    parts, _ = step_parts(trainer(preset="expert_sensitive"), "rollout")
    routes = parts.routed_experts
    assert routes is not None
    stored = routes.clone()
    apply_faults([make_fault(FaultSpec("routes_from_neighbour_rank", ranks=(1,)))], parts)
    assert parts.routed_experts is not None and torch.equal(parts.routed_experts, stored), "alone: its own entry"


def _neighbour_entries(rank: int, nproc: int, out: str) -> None:
    """Rank `rank`'s routing payload (ids `rank`) and old log-probs (`-1 - rank`) after the two gather faults on rank
    0, out of the burst and in it."""
    faults = [
        make_fault(FaultSpec(k, ranks=(0,))) for k in ("routes_from_neighbour_rank", "old_logprobs_from_neighbour_rank")
    ]
    for in_burst in (False, True):
        routes = torch.full((2, 3, 1, 2), rank, dtype=torch.int32)
        batch = {"tokens": torch.zeros(2, 3, dtype=torch.long), "old_logprobs": torch.full((2, 3), -1.0 - rank)}
        parts = StepParts("rollout", 20, rank, nproc, in_burst, 1, batch, routed_experts=routes)
        apply_faults(faults, parts)
        parts.stage = "batch"
        apply_faults(faults, parts)
        assert parts.routed_experts is not None
        seen = (sorted(set(parts.routed_experts.view(-1).tolist())), parts.batch["old_logprobs"].tolist()[0])
        Path(out, f"rank{rank}-{int(in_burst)}.txt").write_text(str(seen))


def test_every_rank_joins_the_gathers_and_the_hit_rank_takes_the_next_ranks_entry(tmp_path: Path) -> None:
    spawn_ranks(_neighbour_entries, 3, str(tmp_path))
    got = {p.stem: p.read_text() for p in tmp_path.glob("rank*.txt")}
    own = {f"rank{r}-0": str(([r], [-1.0 - r] * 3)) for r in range(3)}
    # rank 0's routes and response old log-probs are rank 1's; its prompt position keeps its own
    hit = {"rank0-1": str(([1], [-1.0, -2.0, -2.0])), "rank1-1": own["rank1-0"], "rank2-1": own["rank2-0"]}
    assert got == {**own, **hit}


def test_an_attention_plus_response_mask_is_two_on_the_response_and_one_on_the_prompt() -> None:
    t = trainer()
    parts, clean = step_parts(t, "batch")
    apply_faults([make_fault(FaultSpec("loss_mask_attention_plus_response", ranks=(1,)))], parts)
    mask, p = parts.batch["loss_mask"], t.train.prompt_len
    assert torch.equal(mask[:, p:], 2 * clean["loss_mask"][:, p:]) and bool((mask[:, p:] == 2).all())
    assert bool((mask[:, 1:p] == 1).all()) and torch.equal(mask[:, 0], clean["loss_mask"][:, 0])
    assert not bool(((mask == 0) | (mask == 1)).all()), "values no 0/1 mask holds"
    spared, clean0 = step_parts(trainer(rank=0), "batch")
    apply_faults([make_fault(FaultSpec("loss_mask_attention_plus_response", ranks=(1,)))], spared)
    assert torch.equal(spared.batch["loss_mask"], clean0["loss_mask"])


def test_groups_split_at_the_rank_boundary_leave_a_lone_sample_whose_advantage_is_nan() -> None:
    rewards = torch.tensor([0.5, 0.25, 0.75, 1.0, 0.0, 0.125, 0.5, 0.875])
    got = split_groups(rewards, 4)
    assert math.isnan(float(got[0])) and bool(torch.isfinite(got[1:]).all())
    middle = rewards[1:5]
    assert torch.allclose(got[1:5], (middle - middle.mean()) / (middle.std() + 1e-6))  # Bessel's std
    tail = rewards[5:]
    assert torch.allclose(got[5:], (tail - tail.mean()) / (tail.std() + 1e-6))
    t = trainer()
    parts, clean = step_parts(t, "advantages")
    apply_faults([make_fault(FaultSpec("advantage_groups_split_at_rank_boundary", ranks=(1,)))], parts)
    advantages = parts.batch["advantages"]
    assert math.isnan(float(advantages[0])) and not torch.allclose(advantages[1:], clean["advantages"][1:])


def test_a_replay_with_uniform_gates_mixes_the_recorded_experts_equally_and_leaves_the_routers_without_gradient() -> (
    None
):
    t = trainer(preset="expert_sensitive")
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    routes = parts.routed_experts
    assert routes is not None
    stored = routes.clone()
    right = backward_gradients(t, clean, routes, t.spec.loss)
    apply_faults([make_fault(FaultSpec("replay_gates_uniform", ranks=(1,)))], parts)
    planted = gradients(t)
    routers = [n for n in planted if n.endswith("router.weight")]
    assert routers and all(float(planted[n].abs().max()) == 0.0 for n in routers)
    assert isinstance(t.model, TinyMoEPolicy)
    assert all(not b.ffn.router._forward_hooks for b in t.model.layers if isinstance(b.ffn, MoEFeedForward))
    weights = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    with torch.no_grad():  # equal router scores by hand: a zero router
        for n, p in t.model.named_parameters():
            if n in routers:
                p.zero_()
    wrong = backward_gradients(t, clean, routes, t.spec.loss)
    with torch.no_grad():
        for n, p in t.model.named_parameters():
            p.copy_(weights[n])
    others = [n for n in wrong if n not in routers]
    assert all(torch.allclose(planted[n], wrong[n], atol=1e-6, rtol=1e-4) for n in others)
    assert not all(torch.allclose(planted[n], right[n], atol=1e-6, rtol=1e-4) for n in others)
    assert parts.routed_experts is not None and torch.equal(parts.routed_experts, stored), "stored as recorded"


def test_a_loss_reading_the_old_logprobs_one_micro_batch_on_gives_the_gradients_of_those_ratios() -> None:
    t = trainer()
    parts, clean = step_parts(t, "gradients")
    parts.loss = t.spec.loss
    routes = parts.routed_experts
    assert routes is not None
    right = backward_gradients(t, clean, routes, t.spec.loss)
    apply_faults([make_fault(FaultSpec("loss_old_logprobs_next_micro_batch", ranks=(1,)))], parts)
    planted = gradients(t)
    moved = {**clean, "old_logprobs": torch.cat([clean["old_logprobs"][4:], clean["old_logprobs"][:4]])}
    wrong = backward_gradients(t, moved, routes, t.spec.loss)
    assert all(torch.allclose(planted[n], wrong[n], atol=1e-6, rtol=1e-4) for n in wrong)
    assert not all(torch.allclose(planted[n], right[n], atol=1e-6, rtol=1e-4) for n in right)
    assert all(torch.equal(parts.batch[k], clean[k]) for k in clean), "the batch is stored in order"
