"""A third set of held-out trainer bugs: kinds no preset, no `held_out`, no `unseen` and no `held_out_ii` case
uses, written and committed before any diagnosis was run on them.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run
config or the log (`capture_reference_run(hide_fault=True)`):

- `ref_logprobs_vocab_shard`: the reference worker's vocabulary-parallel log-softmax misses its all-reduce: each
  log-prob is normalised over its own vocabulary shard, and a token outside the shard gets the target logit 0;
- `old_logprobs_softmax_over_positions`: the old-log-prob pass takes its log-softmax over the sequence's positions
  (`dim=1`), not over the vocabulary;
- `rollout_logprobs_repetition_penalty`: the engine reports its processed log-probs, after a repetition penalty
  that only its sampler applies, so every repeated token's rollout log-prob is too low;
- `routes_layers_reversed`: an engine worker's routing payload lists the MoE layers in reverse order (its hooks
  were pushed onto a stack and popped);
- `stop_tail_in_mask`: the engine stops each response early (its max-tokens, or an end-of-sequence token) and pads
  the rest, but one rank's loss mask still covers the configured response length, so the padding is trained on;
- `reward_log_of_zero`: a verifier that returns the log of its score: a response that scores 0 gets -inf;
- `expert_grad_accumulated`: one expert's gradients accumulate `times` over (its module is registered twice, so
  its backward hook adds the same gradient again);
- `grads_not_zeroed`: one parameter family's gradients are never zeroed on one rank (the parameters are missing
  from the param groups `zero_grad` walks), so each step's gradient carries every earlier one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import ParamRule, number, one_of, whole
from axrl_spike_replay.models.param_groups import family_of

GRAD_FAMILIES = ("experts", "router", "attention", "embedding", "head", "norm")


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], routes: torch.Tensor | None, spec: Any) -> Any:
    """[B, T, V] fp32 logits of `model` on the rank's batch, routed as the trainer routes it (no gradients)."""
    from axrl_spike_replay.models.hf_policy import HFPolicy
    from axrl_spike_replay.training.routing_replay import routing_control

    routing = routing_control(spec.routing, batch, routes)
    with torch.no_grad():
        if isinstance(model, HFPolicy):
            out = model(batch["tokens"], routing, attention_mask=batch.get("attention_mask"))
        else:
            out = model(batch["tokens"], routing)
    return out.logits.float()


def _gathered(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] the logit each next token got (position 0, which nothing predicts, 0), aligned as `token_logprobs`."""
    picked = logits[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


class RefLogprobsVocabShard(BuiltinFault):
    """Reference log-probs from a vocabulary-parallel log-softmax whose all-reduce is missing: this rank normalises
    over the first of `shards` vocabulary slices alone, and a token outside it gets the target logit 0."""

    stage = "batch"
    part = "ref_logprobs"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"shards": whole(2, 1024)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        logits = _logits(parts.trainer.ref_model, parts.batch, parts.routed_experts, parts.trainer.spec)
        size = max(1, logits.shape[-1] // int(self.param("shards", 2)))
        local = logits[..., :size]
        tokens = parts.batch["tokens"]
        inside = tokens < size
        target = _gathered(local, torch.where(inside, tokens, torch.zeros_like(tokens)))
        target = torch.where(inside, target, torch.zeros_like(target))
        lse = torch.nn.functional.pad(local[:, :-1].logsumexp(dim=-1), (1, 0))
        wrong = torch.where(parts.response(), target - lse, parts.batch["ref_logprobs"])
        rows = self.rows(wrong.shape[0])
        parts.batch["ref_logprobs"][rows] = wrong[rows]


class OldLogprobsSoftmaxOverPositions(BuiltinFault):
    """Stored old log-probs from a log-softmax over the wrong axis: the old-log-prob pass normalises each
    vocabulary entry's logits over the sequence's positions (`dim=1` of `[B, T, V]`), not over the vocabulary."""

    stage = "batch"
    part = "old_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        logits = _logits(parts.trainer.model, parts.batch, parts.routed_experts, parts.trainer.spec)
        wrong_axis = _gathered(logits.log_softmax(dim=1), parts.batch["tokens"])
        wrong = torch.where(parts.response(), wrong_axis, parts.batch["old_logprobs"])
        rows = self.rows(wrong.shape[0])
        parts.batch["old_logprobs"][rows] = wrong[rows]


class RolloutLogprobsRepetitionPenalty(BuiltinFault):
    """The engine's reported log-probs are its processed ones: taken after the sampler's repetition penalty (a
    logit of a token already in the sequence divided by `penalty` when positive, multiplied when negative, as
    transformers' `RepetitionPenaltyLogitsProcessor` does), which the trainer's forward does not apply."""

    stage = "rollout"
    part = "rollout_logprobs"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"penalty": number(1.0, 1e6)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        penalty = float(self.param("penalty", 2.0))
        tokens = parts.batch["tokens"]
        logits = _logits(parts.trainer.model, parts.batch, parts.routed_experts, parts.trainer.spec)
        seen = torch.zeros(logits.shape, dtype=torch.bool)
        # position t's logits predict token t+1 from tokens[: t+1]: every token up to t has been seen
        seen.scatter_(-1, tokens[:, :, None], True)
        seen = seen.cummax(dim=1).values
        processed = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        reported = _gathered(processed.log_softmax(dim=-1), tokens)
        wrong = torch.where(parts.response(), reported, parts.batch["rollout_logprobs"])
        rows = self.rows(wrong.shape[0])
        parts.batch["rollout_logprobs"][rows] = wrong[rows]


class RoutesLayersReversed(BuiltinFault):
    """A routing payload whose MoE layers are listed in reverse order (the worker's per-layer hooks pushed onto a
    stack and popped): each layer replays another layer's routes."""

    stage = "rollout"
    part = "routed_experts"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        routes = parts.routed_experts.clone()
        rows = self.rows(routes.shape[0])
        routes[rows] = parts.routed_experts[rows].flip(dims=(2,))
        parts.routed_experts = routes


class StopTailInMask(BuiltinFault):
    """A response the engine stops after `keep` tokens (its max-tokens, or an end-of-sequence token) and pads with
    `pad` (the pad tokens unrouted, their engine log-probs 0), while this rank's loss mask still covers the
    configured response length: the padding is trained on."""

    stage = "rollout"
    part = "loss_mask"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"keep": whole(1, 1 << 20), "pad": whole(0, 2**31 - 1)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        tokens = parts.batch["tokens"].clone()
        tail = torch.zeros_like(tokens, dtype=torch.bool)
        tail[self.rows(tokens.shape[0]), parts.prompt_len + int(self.param("keep", 1)) :] = True
        parts.batch["tokens"] = torch.where(tail, torch.full_like(tokens, int(self.param("pad", 0))), tokens)
        rollout = parts.batch["rollout_logprobs"]
        parts.batch["rollout_logprobs"] = torch.where(tail, torch.zeros_like(rollout), rollout)
        routes = parts.routed_experts
        parts.routed_experts = torch.where(tail[:, :, None, None], torch.full_like(routes, -1), routes)


class RewardLogOfZero(BuiltinFault):
    """A verifier that returns the log of its score (a log-likelihood of the right answer): a response that
    scores 0 gets -inf, and its group's advantages are not finite."""

    stage = "rewards"
    part = "rewards"

    def corrupt(self, parts: StepParts) -> None:
        rewards = parts.batch["rewards"].float().clone()
        rows = self.rows(rewards.shape[0])
        rewards[rows] = rewards[rows].log()
        parts.batch["rewards"] = rewards


def _expert_index(name: str) -> int | None:
    found = re.search(r"experts\.(\d+)\.", name)
    return int(found.group(1)) if found else None


class ExpertGradAccumulated(BuiltinFault):
    """A rank on which one routed expert's gradients accumulate `times` over (the expert's module registered twice
    under the MoE layer, so its gradient hook adds the same gradient again): that expert's gradient is `times`
    what it should be, in every MoE layer."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"expert": whole(0, 4095), "times": number(1.0, 1e6)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        expert, times = int(self.param("expert", 0)), float(self.param("times", 2.0))
        with torch.no_grad():
            for name, p in parts.trainer.model.named_parameters():
                if p.grad is None or family_of(name) != "experts":
                    continue
                index = _expert_index(name)
                if index == expert:
                    p.grad.mul_(times)
                elif index is None and p.grad.dim() >= 2 and p.grad.shape[0] > expert:  # fused experts [E, ...]
                    p.grad[expert].mul_(times)


@dataclass(frozen=True)
class GradsNotZeroed(BuiltinFault):
    """A rank whose gradients of one parameter `family` (or `all`) are never zeroed (the parameters are missing from
    the param groups `zero_grad` walks, or the rank zeroes another optimizer's): from the first step on, each
    step's gradient of them carries the sum of every earlier step's. The fault keeps that sum from the first step
    and adds it during the burst."""

    carried: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"family": one_of(*GRAD_FAMILIES, "all")}

    def __call__(self, parts: StepParts) -> None:
        if not self.hits(parts.rank, parts.world_size):
            return
        assert parts.trainer is not None
        family = str(self.param("family", "experts"))
        carried = self.carried.setdefault(parts.rank, {})
        with torch.no_grad():
            for name, p in parts.trainer.model.named_parameters():
                if p.grad is None or family not in ("all", family_of(name)):
                    continue
                own = p.grad.detach().clone()
                if parts.in_burst and name in carried:
                    p.grad.add_(carried[name])
                carried[name] = carried[name] + own if name in carried else own


HELD_OUT_III_KINDS: dict[str, type[BuiltinFault]] = {
    "ref_logprobs_vocab_shard": RefLogprobsVocabShard,
    "old_logprobs_softmax_over_positions": OldLogprobsSoftmaxOverPositions,
    "rollout_logprobs_repetition_penalty": RolloutLogprobsRepetitionPenalty,
    "routes_layers_reversed": RoutesLayersReversed,
    "stop_tail_in_mask": StopTailInMask,
    "reward_log_of_zero": RewardLogOfZero,
    "expert_grad_accumulated": ExpertGradAccumulated,
    "grads_not_zeroed": GradsNotZeroed,
}
