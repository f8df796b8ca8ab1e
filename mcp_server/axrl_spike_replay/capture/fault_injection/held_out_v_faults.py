"""A fifth set of held-out trainer bugs: kinds no preset and no `held_out`, `unseen`, `held_out_ii`, `held_out_iii`
or `held_out_iv` case uses, written and committed before any diagnosis was run on them.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run
config or the log (`capture_reference_run(hide_fault=True)`). Three are in the trainer's loss (`gradients` stage:
the rank's gradients are those of the wrong loss, while its snapshot stores the batch and the settings it should
have used, as a trainer that logs its inputs does); five are in the data it stores:

- `ratio_against_reference`: the loss takes its importance ratio against the reference log-probs where it should
  take it against the old policy's (two tensors of the same shape swapped in the loss's call);
- `loss_label_shift`: the loss pairs each position's new log-prob with the old log-prob of the position before it
  (the label shift applied a second time to one of the two tensors);
- `loss_mask_not_applied`: the loss averages over every position, prompt included (its mask argument dropped), while
  the rank stores the right mask;
- `advantage_divided_by_variance`: GRPO's group deviation divided by the group's variance, not its std
  (`var()` where `std()` was meant);
- `routes_previous_step`: an engine worker hands over its previous step's routing payload (a ring buffer whose index
  is never advanced): the routes of other tokens;
- `routes_one_layer_broadcast`: the routing payload's gather reads the first MoE layer's routes for every MoE layer
  (an index into the layer axis that is never advanced);
- `rollout_logprobs_previous_step`: an engine worker reports its previous step's log-probs (a reused output
  buffer), for tokens they were not taken on;
- `ref_logprobs_are_nll`: the reference worker returns the negative log-likelihood its loss kernel computes (a
  cross-entropy, positive), not the log-prob.
"""

from __future__ import annotations

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts


def _backward_again(parts: StepParts, batch: dict[str, torch.Tensor]) -> None:
    """The rank's gradients replaced by those of its loss on `batch` (the tensors the buggy loss read)."""
    from axrl_spike_replay.training.rank_step import rank_forward_backward

    assert parts.trainer is not None and parts.loss is not None
    model = parts.trainer.model
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        rank_forward_backward(model, batch, parts.loss, parts.routing())


class RatioAgainstReference(BuiltinFault):
    """A loss whose importance ratio is taken against the reference log-probs, not the old policy's."""

    stage = "gradients"
    part = "gradients"

    def corrupt(self, parts: StepParts) -> None:
        batch = dict(parts.batch)
        old = batch["old_logprobs"].clone()
        rows = self.rows(old.shape[0])
        old[rows] = batch["ref_logprobs"][rows]
        batch["old_logprobs"] = old
        _backward_again(parts, batch)


class LossLabelShift(BuiltinFault):
    """A loss that pairs each position's new log-prob with the old log-prob one position earlier."""

    stage = "gradients"
    part = "gradients"

    def corrupt(self, parts: StepParts) -> None:
        batch = dict(parts.batch)
        old = batch["old_logprobs"].clone()
        late = torch.cat([old[:, :1], old[:, :-1]], dim=1)
        rows = self.rows(old.shape[0])
        old[rows] = late[rows]
        batch["old_logprobs"] = old
        _backward_again(parts, batch)


class LossMaskNotApplied(BuiltinFault):
    """A loss that averages over every position of the rank's batch, prompt included: its mask argument dropped
    (a `masked_mean(x, mask)` become `x.mean()`), while the batch it stores keeps the right mask."""

    stage = "gradients"
    part = "gradients"

    def corrupt(self, parts: StepParts) -> None:
        batch = dict(parts.batch)
        mask = batch["loss_mask"].clone()
        rows = self.rows(mask.shape[0])
        mask[rows] = 1.0
        mask[:, 0] = batch["loss_mask"][:, 0]  # position 0: nothing predicts it, it has no log-prob
        batch["loss_mask"] = mask
        _backward_again(parts, batch)


class AdvantageDividedByVariance(BuiltinFault):
    """GRPO advantages whose group deviation is divided by the group's variance (plus the run's epsilon), not
    its std: a group of close rewards gets advantages 1 / std times too large."""

    stage = "advantages"
    part = "advantages"

    def corrupt(self, parts: StepParts) -> None:
        groups, unbiased = parts.reward_groups()
        var = groups.var(dim=-1, keepdim=True, unbiased=unbiased)
        advantages = ((groups - groups.mean(dim=-1, keepdim=True)) / (var + 1e-6)).reshape(-1)
        self.replace_rows(parts, "advantages", advantages)


class RoutesPreviousStep(BuiltinFault):
    """A routing payload from the engine's previous step (its ring buffer's index never advanced): the hit
    samples' routes are those the previous step's samples of the same rows took."""

    stage = "rollout"
    part = "routed_experts"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None and parts.routed_experts is not None
        before = getattr(parts.trainer, "previous_routes", None)
        if not isinstance(before, torch.Tensor) or before.shape != parts.routed_experts.shape:
            return
        routes = parts.routed_experts.clone()
        rows = self.rows(routes.shape[0])
        routes[rows] = before[rows].to(routes.dtype)
        parts.routed_experts = routes


class RoutesOneLayerBroadcast(BuiltinFault):
    """A routing payload whose every MoE layer holds the first MoE layer's routes."""

    stage = "rollout"
    part = "routed_experts"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        routes = parts.routed_experts.clone()
        rows = self.rows(routes.shape[0])
        first = routes[rows][:, :, :1]
        routes[rows] = first.expand_as(routes[rows]).clone()
        parts.routed_experts = routes


class RolloutLogprobsPreviousStep(BuiltinFault):
    """Engine log-probs from the engine's previous step (a reused output buffer): taken on other tokens."""

    stage = "rollout"
    part = "rollout_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        previous = parts.previous or {}
        before = previous.get("rollout_logprobs")
        lp = parts.batch["rollout_logprobs"]
        if not isinstance(before, torch.Tensor) or before.shape != lp.shape:
            return
        lp = lp.clone()
        rows = self.rows(lp.shape[0])
        stale = torch.where(parts.response(), before.to(lp.dtype), lp)
        lp[rows] = stale[rows]
        parts.batch["rollout_logprobs"] = lp


class RefLogprobsAreNll(BuiltinFault):
    """Reference log-probs that are the response tokens' negative log-likelihoods (the sign of a cross-entropy)."""

    stage = "batch"
    part = "ref_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        ref = parts.batch["ref_logprobs"]
        flipped = torch.where(parts.response(), -ref, ref)
        rows = self.rows(ref.shape[0])
        out = ref.clone()
        out[rows] = flipped[rows]
        parts.batch["ref_logprobs"] = out


HELD_OUT_V_KINDS: dict[str, type[BuiltinFault]] = {
    "ratio_against_reference": RatioAgainstReference,
    "loss_label_shift": LossLabelShift,
    "loss_mask_not_applied": LossMaskNotApplied,
    "advantage_divided_by_variance": AdvantageDividedByVariance,
    "routes_previous_step": RoutesPreviousStep,
    "routes_one_layer_broadcast": RoutesOneLayerBroadcast,
    "rollout_logprobs_previous_step": RolloutLogprobsPreviousStep,
    "ref_logprobs_are_nll": RefLogprobsAreNll,
}
