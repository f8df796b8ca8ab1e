"""A sixth set of held-out trainer bugs: kinds no preset and no `held_out`, `unseen`, `held_out_ii`, `held_out_iii`,
`held_out_iv` or `held_out_v` case uses, written and committed before any diagnosis was run on them.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run
config or the log (`capture_reference_run(hide_fault=True)`):

- `advantage_mean_not_subtracted`: GRPO's standardisation lost its centring in a refactor (`scores / (std + eps)`,
  the `- mean` gone): a group of close rewards gets its rewards over a small std;
- `old_logprobs_sequence_sum`: the old-log-prob helper returns the sequence's log-prob (the masked sum over its
  tokens, with `keepdim=True`, as a sequence-level ratio wants it) where the loss reads per-token values: the sum,
  broadcast to every position;
- `ref_logprobs_are_entropy`: the reference worker's fused kernel returns `(entropy, logprobs)` and its caller
  unpacks them in the other order: the stored reference log-probs are the reference's entropies;
- `rollout_logprobs_first_sequence`: the engine's batched call returns its log-probs as `[B, T]` and the client
  takes `outputs[0]` for every request (the first sequence's log-probs broadcast over the batch): each sequence's
  tokens scored with the first sequence's log-probs;
- `routes_token_major_view`: the engine's routing buffer is token-major (`[T, B, ...]`) and the trainer `view`s it
  as sample-major (`[B, T, ...]`) without a transpose: each position gets the routes of another sample's token;
- `routes_layer_off_by_one`: the routing payload's MoE layer slots are filled from 1-based layer ids: each slot
  holds the routes of the MoE layer after it (the last keeps its own);
- `replay_routes_offset_by_micro_batch`: the training forward's routing replay keeps a read offset into the payload
  that is not reset per micro-batch, so each sequence runs with the routes of the sequence one micro-batch further
  on (`gradients` stage: the rank's gradients are those of the wrongly routed forward, while its snapshot stores the
  payload in order, as the engine recorded it);
- `ref_logprobs_of_argmax`: the reference worker gathers the log-prob of its own greedy token (an index from
  `logits.argmax` where the sampled ids were meant), not of the sampled one.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import ParamRule, whole


def _aligned_log_softmax(model: torch.nn.Module, parts: StepParts) -> torch.Tensor:
    """[B, T, V] fp32 log-probs of `model` on the rank's batch, routed as the trainer routes it, aligned with the
    tokens they score (position t: the distribution over token t; position 0, which nothing predicts: zeros)."""
    from axrl_spike_replay.models.hf_policy import HFPolicy

    tokens = parts.batch["tokens"]
    with torch.no_grad():
        if isinstance(model, HFPolicy):
            out = model(tokens, parts.routing(), attention_mask=parts.batch.get("attention_mask"))
        else:
            out = model(tokens, parts.routing())
    logp = out.logits.float()[:, :-1].log_softmax(dim=-1)
    return torch.nn.functional.pad(logp, (0, 0, 1, 0))


def _write_rows(parts: StepParts, name: str, wrong: torch.Tensor, fault: BuiltinFault) -> None:
    """`parts.batch[name]`'s hit rows replaced by `wrong`'s on the response positions."""
    values = parts.batch[name]
    fault.replace_rows(parts, name, torch.where(parts.response(), wrong.to(values.dtype), values))


class AdvantageMeanNotSubtracted(BuiltinFault):
    """GRPO advantages of rewards over the group's std, the group mean never subtracted."""

    stage = "advantages"
    part = "advantages"

    def corrupt(self, parts: StepParts) -> None:
        groups, unbiased = parts.reward_groups()
        std = groups.std(dim=-1, keepdim=True, unbiased=unbiased)
        advantages = (groups / (std + 1e-6)).reshape(-1)
        self.replace_rows(parts, "advantages", advantages)


class OldLogprobsSequenceSum(BuiltinFault):
    """Stored old log-probs that are each sequence's log-prob (the sum over its loss tokens), at every position."""

    stage = "batch"
    part = "old_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        old = parts.batch["old_logprobs"]
        on = parts.batch["loss_mask"] > 0
        total = torch.where(on, old, torch.zeros_like(old)).sum(dim=-1, keepdim=True)  # off the mask: any value
        out = old.clone()
        rows = self.rows(out.shape[0])
        out[rows] = total.expand_as(old)[rows].to(out.dtype)
        parts.batch["old_logprobs"] = out


class RefLogprobsAreEntropy(BuiltinFault):
    """Reference log-probs that are the reference's entropies at each position (a returned pair unpacked the other
    way round)."""

    stage = "batch"
    part = "ref_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        logp = _aligned_log_softmax(parts.trainer.ref_model, parts)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        _write_rows(parts, "ref_logprobs", entropy, self)


class RefLogprobsOfArgmax(BuiltinFault):
    """Reference log-probs of the reference's greedy token at each position, not of the sampled token."""

    stage = "batch"
    part = "ref_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        logp = _aligned_log_softmax(parts.trainer.ref_model, parts)
        _write_rows(parts, "ref_logprobs", logp.max(dim=-1).values, self)


class RolloutLogprobsFirstSequence(BuiltinFault):
    """Engine log-probs of the batch's first sequence reported for every sequence of the batch."""

    stage = "rollout"
    part = "rollout_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        lp = parts.batch["rollout_logprobs"]
        _write_rows(parts, "rollout_logprobs", lp[:1].expand_as(lp), self)


class RoutesTokenMajorView(BuiltinFault):
    """A routing payload whose token-major buffer (`[T, B, L, K]`) is viewed as sample-major (`[B, T, L, K]`)."""

    stage = "rollout"
    part = "routed_experts"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        routes = parts.routed_experts
        viewed = routes.transpose(0, 1).contiguous().view(routes.shape)
        out = routes.clone()
        rows = self.rows(out.shape[0])
        out[rows] = viewed[rows]
        parts.routed_experts = out


class RoutesLayerOffByOne(BuiltinFault):
    """A routing payload whose MoE layer slot `l` holds the routes of MoE layer `l + 1` (the last keeps its own)."""

    stage = "rollout"
    part = "routed_experts"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        routes = parts.routed_experts
        if routes.shape[2] < 2:
            return  # one MoE layer: no neighbour to read
        moved = torch.cat([routes[:, :, 1:], routes[:, :, -1:]], dim=2)
        out = routes.clone()
        rows = self.rows(out.shape[0])
        out[rows] = moved[rows]
        parts.routed_experts = out


class ReplayRoutesOffsetByMicroBatch(BuiltinFault):
    """A training forward whose routing replay reads the payload one micro-batch (`rows` samples) further on than
    the sequences it runs, while the rank stores the payload in order."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"rows": whole(1, 4096)}

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.training.rank_step import rank_forward_backward
        from axrl_spike_replay.training.routing_replay import routing_control

        assert parts.trainer is not None and parts.loss is not None and parts.routed_experts is not None
        offset = int(self.param("rows", 4)) % parts.routed_experts.shape[0]
        routes = parts.routed_experts.clone()
        rows = self.rows(routes.shape[0])
        routes[rows] = torch.roll(parts.routed_experts, shifts=-offset, dims=0)[rows]
        model = parts.trainer.model
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            rank_forward_backward(
                model, parts.batch, parts.loss, routing_control(parts.trainer.spec.routing, parts.batch, routes)
            )


HELD_OUT_VI_KINDS: dict[str, type[BuiltinFault]] = {
    "advantage_mean_not_subtracted": AdvantageMeanNotSubtracted,
    "old_logprobs_sequence_sum": OldLogprobsSequenceSum,
    "ref_logprobs_are_entropy": RefLogprobsAreEntropy,
    "ref_logprobs_of_argmax": RefLogprobsOfArgmax,
    "rollout_logprobs_first_sequence": RolloutLogprobsFirstSequence,
    "routes_token_major_view": RoutesTokenMajorView,
    "routes_layer_off_by_one": RoutesLayerOffByOne,
    "replay_routes_offset_by_micro_batch": ReplayRoutesOffsetByMicroBatch,
}
