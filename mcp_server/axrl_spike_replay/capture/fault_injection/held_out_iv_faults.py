"""A fourth set of held-out trainer bugs: kinds no preset, no `held_out`, no `unseen`, no `held_out_ii` and no
`held_out_iii` case uses, written and committed before any diagnosis was run on them.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run
config or the log (`capture_reference_run(hide_fault=True)`):

- `ref_logprobs_unnormalised`: the reference worker returns the sampled token's raw logit (its fused
  gather-and-log-softmax kernel called with the normalisation off), not its log-prob;
- `old_logprobs_adapter_disabled`: the old-log-prob pass runs inside the context that disables the policy's
  trained weights for the reference pass (a PEFT `disable_adapter()` block that covers both): the stored old
  log-probs are the reference's;
- `routes_read_before_copy`: an engine worker reads its routing payload before the asynchronous device-to-host
  copy has landed (`non_blocking=True` with no synchronise): the buffer still holds its zeros, every token routed to
  expert 0;
- `advantage_std_without_eps`: GRPO's group std with no epsilon: a group whose rewards are all equal gets 0 / 0;
- `engine_sampling_temperature`: one engine replica samples at another temperature than the run's (its launch
  config), and reports its raw log-probs (temperature 1), as inference engines do by default: the responses are
  not the policy's own samples, though every stored signal scores them right;
- `loss_mask_inverted`: one rank's loss mask comes from a padding mask of the other convention (True where a
  position is to be left out, as `key_padding_mask` takes it): the prompt is trained on, the response is not;
- `rollout_logprobs_base2`: the engine's log-probs are base-2 logarithms (its sampler kernel works with exp2 and
  log2, as fused softmax kernels do) reported without the factor ln 2;
- `advantages_summed_over_positions`: a sequence advantage broadcast to every position of the sequence and summed
  back without the mask (a token-level advantage reduced the wrong way): each advantage is the sequence length
  times what it should be;
- `entropy_bonus_summed`: one rank's actor adds an entropy bonus from its own default coefficient (the run's is
  0), summed over the tokens where a bonus is averaged;
- `positions_not_reset_after_packing`: one rank packs its sequences for the training forward and counts the
  position ids from the pack's start, not each sequence's, while its old-log-prob pass (unpacked) counts from 0:
  the training forward sees every sequence `offset` positions late.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import ParamRule, number, whole


class RefLogprobsUnnormalised(BuiltinFault):
    """Reference log-probs that are the sampled tokens' raw logits (the log-softmax's normaliser never subtracted)."""

    stage = "batch"
    part = "ref_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.models.hf_policy import HFPolicy

        assert parts.trainer is not None
        model, tokens = parts.trainer.ref_model, parts.batch["tokens"]
        with torch.no_grad():
            if isinstance(model, HFPolicy):
                out = model(tokens, parts.routing(), attention_mask=parts.batch.get("attention_mask"))
            else:
                out = model(tokens, parts.routing())
        raw = out.logits.float()[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
        raw = torch.nn.functional.pad(raw, (1, 0))
        wrong = torch.where(parts.response(), raw, parts.batch["ref_logprobs"])
        rows = self.rows(wrong.shape[0])
        parts.batch["ref_logprobs"][rows] = wrong[rows]


class OldLogprobsAdapterDisabled(BuiltinFault):
    """Stored old log-probs taken with the policy's trained weights switched off (the reference's weights): the
    old-log-prob pass ran inside the block that disables the adapter for the reference pass."""

    stage = "batch"
    part = "old_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        rows = self.rows(parts.batch["old_logprobs"].shape[0])
        parts.batch["old_logprobs"][rows] = parts.batch["ref_logprobs"][rows].clone()


class RoutesReadBeforeCopy(BuiltinFault):
    """A routing payload read before its asynchronous device-to-host copy landed: the host buffer's zeros, so every
    token of the hit samples is replayed through expert 0 in every top-k slot of every MoE layer."""

    stage = "rollout"
    part = "routed_experts"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        routes = parts.routed_experts.clone()
        routes[self.rows(routes.shape[0])] = 0
        parts.routed_experts = routes


class AdvantageStdWithoutEps(BuiltinFault):
    """GRPO advantages standardised by the group's std with no epsilon: a group of equal rewards gives 0 / 0 (NaN)
    for each of its samples; the other groups are as the run computes them, to rounding."""

    stage = "advantages"
    part = "advantages"

    def corrupt(self, parts: StepParts) -> None:
        groups, unbiased = parts.reward_groups()
        std = groups.std(dim=-1, keepdim=True, unbiased=unbiased)
        advantages = ((groups - groups.mean(dim=-1, keepdim=True)) / std).reshape(-1)
        self.replace_rows(parts, "advantages", advantages)


class EngineSamplingTemperature(BuiltinFault):
    """An engine replica that samples this rank's responses at `temperature` (not the run's) and reports its raw
    log-probs (temperature 1) and the routes of the sequences it sampled: every stored signal agrees with the
    tokens, but the tokens are not the policy's own samples."""

    stage = "rollout"
    part = "tokens"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"temperature": number(0.05, 100.0)}

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.capture.reference.rollout import generate, rollout_engine
        from axrl_spike_replay.models.tiny_moe import token_logprobs

        assert parts.trainer is not None and parts.generator is not None and parts.routed_experts is not None
        tokens = parts.batch["tokens"]
        engine = rollout_engine(parts.trainer.rollout_policy())
        hot = generate(
            engine,
            tokens[:, : parts.prompt_len],
            tokens.shape[1] - parts.prompt_len,
            parts.generator,
            temperature=float(self.param("temperature", 3.0)),
        )
        with torch.no_grad():
            out = engine(hot.tokens)
        raw = token_logprobs(out.logits.float(), hot.tokens).float()
        rows = self.rows(tokens.shape[0])
        new_tokens, logprobs, routes = tokens.clone(), parts.batch["rollout_logprobs"].clone(), parts.routed_experts
        routes = routes.clone()
        new_tokens[rows], logprobs[rows] = hot.tokens[rows], raw[rows]
        routes[rows] = out.routes.to(routes.dtype)[rows]
        parts.batch["tokens"], parts.batch["rollout_logprobs"], parts.routed_experts = new_tokens, logprobs, routes


class LossMaskInverted(BuiltinFault):
    """A loss mask of the other convention (1 where a position is to be left out): the prompt's positions are
    trained on with their sample's advantage, the response's are not."""

    stage = "batch"
    part = "loss_mask"

    def corrupt(self, parts: StepParts) -> None:
        mask = parts.batch["loss_mask"].clone()
        rows = self.rows(mask.shape[0])
        mask[rows] = 1.0 - mask[rows]
        parts.batch["loss_mask"] = mask


class RolloutLogprobsBase2(BuiltinFault):
    """Engine log-probs reported in base 2 (log2 p = ln p / ln 2): every response token's rollout log-prob is
    1.44 times what it should be."""

    stage = "rollout"
    part = "rollout_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        lp = parts.batch["rollout_logprobs"].clone()
        rows = self.rows(lp.shape[0])
        base2 = torch.where(parts.response(), lp / math.log(2.0), lp)
        lp[rows] = base2[rows]
        parts.batch["rollout_logprobs"] = lp


class AdvantagesSummedOverPositions(BuiltinFault):
    """Each sequence advantage broadcast to all the sequence's positions and summed back without the mask: the
    sequence length times the advantage."""

    stage = "advantages"
    part = "advantages"

    def corrupt(self, parts: StepParts) -> None:
        advantages = parts.batch["advantages"]
        length = parts.batch["tokens"].shape[1]
        summed = advantages[:, None].expand(-1, length).sum(dim=-1)
        out = advantages.clone()
        rows = self.rows(out.shape[0])
        out[rows] = summed[rows].to(out.dtype)
        parts.batch["advantages"] = out


class EntropyBonusSummed(BuiltinFault):
    """A rank whose actor adds an entropy bonus of `coef` (its own default; the run's coefficient is 0) summed over
    the loss tokens, not averaged: its gradients gain `-coef * d(sum of entropies)`, which the run config and its
    recorded loss do not show."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"coef": number(1e-9, 1e6)}

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.models.policy import policy_forward

        assert parts.trainer is not None
        with torch.enable_grad():
            out = policy_forward(parts.trainer.model, parts.batch, parts.routing(), need_entropy=True)
            assert out.entropy is not None
            bonus = (out.entropy.float() * parts.batch["loss_mask"].float()).sum()
            (-float(self.param("coef", 0.01)) * bonus).backward()


@dataclass(frozen=True)
class PositionsNotResetAfterPacking(BuiltinFault):
    """A rank whose training forward (packed) numbers positions from the pack's start: each sequence sits `offset`
    positions late in it, while the old-log-prob pass numbered them from 0. On a learned position table that is
    the table read `offset` rows on: the rows are moved in after the old log-probs (`batch`), and put back after the
    backward (`gradients`) with each row's gradient returned to the row the packed forward read, so the snapshot
    saves the trained table and the rank's true gradients. A model with no position table is left alone."""

    stash: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    stage = "batch"
    stages: ClassVar[tuple[str, ...]] = ("batch", "gradients")
    part = "weights"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"offset": whole(1, 4096)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        table = getattr(parts.trainer.model, "pos", None)
        if not isinstance(table, torch.nn.Embedding):
            return
        weight = table.weight
        offset = min(int(self.param("offset", 1)), weight.shape[0] - parts.batch["tokens"].shape[1])
        if offset <= 0:
            return
        with torch.no_grad():
            if parts.stage == "batch":
                self.stash[parts.rank] = weight.detach().clone()
                weight[:-offset] = self.stash[parts.rank][offset:]
                return
            kept = self.stash.pop(parts.rank, None)
            if kept is None:
                return
            weight.copy_(kept)
            if weight.grad is not None:
                moved = torch.zeros_like(weight.grad)
                moved[offset:] = weight.grad[:-offset]
                weight.grad.copy_(moved)


HELD_OUT_IV_KINDS: dict[str, type[BuiltinFault]] = {
    "ref_logprobs_unnormalised": RefLogprobsUnnormalised,
    "old_logprobs_adapter_disabled": OldLogprobsAdapterDisabled,
    "routes_read_before_copy": RoutesReadBeforeCopy,
    "advantage_std_without_eps": AdvantageStdWithoutEps,
    "engine_sampling_temperature": EngineSamplingTemperature,
    "loss_mask_inverted": LossMaskInverted,
    "rollout_logprobs_base2": RolloutLogprobsBase2,
    "advantages_summed_over_positions": AdvantagesSummedOverPositions,
    "entropy_bonus_summed": EntropyBonusSummed,
    "positions_not_reset_after_packing": PositionsNotResetAfterPacking,
}
