"""A second set of held-out trainer bugs: kinds no preset and no earlier held-out case uses, written before the
diagnosis rules that could read them, so a diagnosis is judged on faults it has not been tuned on.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run config
or the log (`capture_reference_run(hide_fault=True)`):

- `old_logprobs_at_temperature`: the old-log-prob pass divides the logits by the sampling temperature, the training
  forward does not (the stored old log-probs and the trainer's own disagree on every unlikely token);
- `routes_local_expert_ids`: an expert-parallel engine worker records each expert by its id within its own shard
  (`id mod experts-per-shard`), not its global id;
- `advantage_std_singleton_axis`: GRPO's std is taken over an axis of length one (0), so each advantage is the
  centred reward divided by the epsilon alone;
- `weight_decay_in_grad`: an L2 penalty added into one rank's gradients before the reduction (a coupled weight decay
  on one rank's optimizer path), which the run config does not record;
- `stale_layer_shard`: after a resume one rank's training forward runs one decoder layer with its initial weights (its
  shard of that layer was not reloaded); the old log-probs and the checkpoint hold the trained ones;
- `mask_covers_prompt`: one rank builds its loss mask from the attention mask (prompt and response), not the response
  mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import MAX_SCALE, ParamRule, layer_list, number, whole
from axrl_spike_replay.models.param_groups import layer_of


class OldLogprobsAtTemperature(BuiltinFault):
    """Stored old log-probs of `log_softmax(logits / temperature)` (the sampler's path reused for the old-log-prob
    pass), while the training forward takes them at temperature 1."""

    stage = "batch"
    part = "old_logprobs"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"temperature": number(0.05, 20.0)}

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.models.chunked_head import HeadRequest
        from axrl_spike_replay.models.hf_policy import HFPolicy, response_start
        from axrl_spike_replay.training.routing_replay import routing_control

        assert parts.trainer is not None and parts.routed_experts is not None
        temperature = float(self.param("temperature", 0.5))
        model = parts.trainer.model
        batch = parts.batch
        routing = routing_control(parts.trainer.spec.routing, batch, parts.routed_experts)
        with torch.no_grad():
            if isinstance(model, HFPolicy):
                request = HeadRequest(response_start(batch["loss_mask"]), temperature, False)
                out = model(batch["tokens"], routing, attention_mask=batch.get("attention_mask"), head=request)
            else:
                out = model(batch["tokens"], routing, HeadRequest(1, temperature, False))
        hot = out.logprobs.float()
        rows = self.rows(hot.shape[0])
        batch["old_logprobs"][rows] = hot[rows]


class RoutesLocalExpertIds(BuiltinFault):
    """A routing payload of shard-local expert ids: an engine with `ep` expert-parallel shards records each routed
    expert as `id mod (experts / ep)`, so every expert past the first shard is replayed as one of the first shard's."""

    stage = "rollout"
    part = "routed_experts"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"ep": whole(2, 1024)}

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.models.policy import routing_shape

        assert parts.routed_experts is not None and parts.trainer is not None
        n_experts = routing_shape(parts.trainer.spec.model).n_experts
        per_shard = max(1, n_experts // int(self.param("ep", 2)))
        routes = parts.routed_experts
        parts.routed_experts = torch.where(routes >= 0, routes % per_shard, routes).to(routes.dtype)


class AdvantageStdSingletonAxis(BuiltinFault):
    """GRPO advantages whose std is taken over a trailing axis of length one (`std(dim=-1)` on `[B, 1]` rewards):
    the std is 0, so each advantage is the reward minus its group's mean, divided by `eps` alone."""

    stage = "advantages"
    part = "advantages"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"eps": number(1e-12, 1.0)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        group = int(parts.trainer.train.group_size)
        rewards = parts.batch["rewards"].float()
        groups = rewards.view(-1, group)
        centred = groups - groups.mean(dim=-1, keepdim=True)
        std = rewards.view(-1, 1).std(dim=-1, keepdim=True, unbiased=False).view(-1, group)  # zeros
        advantages = (centred / (std + float(self.param("eps", 1e-4)))).reshape(-1)
        rows = self.rows(advantages.shape[0])
        out = parts.batch["advantages"].clone()
        out[rows] = advantages[rows].to(out.dtype)
        parts.batch["advantages"] = out


class WeightDecayInGrad(BuiltinFault):
    """A rank that adds `weight_decay * p` to each gradient before the reduction (a coupled L2 penalty on its
    optimizer path, where the run's optimizer decays decoupled or not at all)."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"weight_decay": number(1e-9, MAX_SCALE)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        decay = float(self.param("weight_decay", 0.1))
        with torch.no_grad():
            for _name, p in parts.trainer.model.named_parameters():
                if p.grad is not None:
                    p.grad.add_(p, alpha=decay)


@dataclass(frozen=True)
class StaleLayerShard(BuiltinFault):
    """A rank whose training forward and backward run decoder `layers` with their initial weights (its shard of
    them was not reloaded on a resume), while its old log-probs and the checkpoint hold the trained weights: the
    weights are swapped in after the old log-probs (`batch`) and the trained ones put back after the backward
    (`gradients`), so the snapshot saves the trained weights."""

    stash: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    stage = "batch"
    stages: ClassVar[tuple[str, ...]] = ("batch", "gradients")
    part = "weights"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"layers": layer_list}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        model, initial = parts.trainer.model, dict(parts.trainer.ref_model.named_parameters())
        layers = set(self.param("layers", None) or [0])
        with torch.no_grad():
            if parts.stage == "batch":
                kept: dict[str, torch.Tensor] = {}
                for name, p in model.named_parameters():
                    if layer_of(name) in layers and name in initial:
                        kept[name] = p.detach().clone()
                        p.copy_(initial[name])
                self.stash[parts.rank] = kept
            else:
                kept = self.stash.pop(parts.rank, {})
                for name, p in model.named_parameters():
                    if name in kept:
                        p.copy_(kept[name])


class MaskCoversPrompt(BuiltinFault):
    """A rank whose loss mask is the attention mask (every position but the first, which nothing predicts), not the
    response mask: the prompt's tokens are trained on with their sample's advantage."""

    stage = "batch"
    part = "loss_mask"

    def corrupt(self, parts: StepParts) -> None:
        mask = parts.batch["loss_mask"].clone()
        for r in self.rows(mask.shape[0]):
            mask[r, 1 : parts.prompt_len] = 1
        parts.batch["loss_mask"] = mask


HELD_OUT_KINDS: dict[str, type[BuiltinFault]] = {
    "old_logprobs_at_temperature": OldLogprobsAtTemperature,
    "routes_local_expert_ids": RoutesLocalExpertIds,
    "advantage_std_singleton_axis": AdvantageStdSingletonAxis,
    "weight_decay_in_grad": WeightDecayInGrad,
    "stale_layer_shard": StaleLayerShard,
    "mask_covers_prompt": MaskCoversPrompt,
}
