"""A seventh set of held-out trainer bugs: kinds no preset and no `held_out`, `unseen`, `held_out_ii`, `held_out_iii`,
`held_out_iv`, `held_out_v` or `held_out_vi` case uses, written and committed before any diagnosis was run on them.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run
config or the log (`capture_reference_run(hide_fault=True)`). Six are in the data the rank's step consumes (the
snapshot stores it as consumed), two in what the trainer does with it (`gradients` stage: the snapshot stores the
batch and payload the step should have used):

- `old_logprobs_last_position_logits`: the old-log-prob pass calls the model as generation calls it (logits of the
  last position only, `logits_to_keep=1`) and broadcasts that one distribution over every position: each token scored
  by the distribution that follows the whole sequence;
- `old_logprobs_labels_not_shifted`: the old-log-prob pass gathers each position's distribution at the position's
  input token (the labels never shifted by one): the log-prob of repeating the previous token, not of the sampled one;
- `ref_logprobs_final_norm_skipped`: the reference worker's fused head takes the hidden states before the model's
  final norm (its hook on the last decoder layer, not on the norm): log-probs of un-normalised hidden states;
- `baseline_all_reduced_sum`: REINFORCE's baseline on one rank is the all-reduced reward sum over every rank's
  samples, the division by their count lost on that rank's path: every advantage there is far below zero;
- `routes_topk_layer_axes_swapped`: the engine stacks its per-layer top-k ids slot-major (`[T, K, L]`) and the
  trainer views the buffer layer-major (`[T, L, K]`) without a transpose: layer and top-k slot are mixed (a token's
  two slots of one layer can name the same expert);
- `loss_mask_as_token_weights`: one rank passes a sequence-mean's per-token weights (`1 / response length` on each
  response token) where the loss expects its 0/1 mask: the token mean then divides by the number of sequences;
- `local_clip_coef_uncapped`: one rank clips its own gradients before the reduction to its launch config's
  `max_norm`, with the coefficient `max_norm / norm` never capped at 1: a small gradient is scaled up to `max_norm`;
- `replay_first_expert_only`: one rank's routing-replay kernel reads each token's first recorded expert for every
  top-k slot (its slot index never used): the rank's training forward runs the first expert `k` times, while its
  snapshot stores the payload as recorded.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import MAX_SCALE, ParamRule, number


def _logits(model: torch.nn.Module, parts: StepParts, skip_final_norm: bool = False) -> torch.Tensor:
    """[B, T, V] fp32 logits of `model` on the rank's batch, routed as the trainer routes it (no gradients);
    `skip_final_norm`: the final norm's input passed on as its output."""
    from axrl_spike_replay.models.hf_policy import HFPolicy

    tokens = parts.batch["tokens"]
    modules = dict(model.named_modules())
    norm = modules.get("model.norm", modules.get("norm"))
    hook: Any = None
    if skip_final_norm and norm is not None:
        hook = norm.register_forward_hook(lambda _module, inputs, _output: inputs[0])
    try:
        with torch.no_grad():
            if isinstance(model, HFPolicy):
                out = model(tokens, parts.routing(), attention_mask=parts.batch.get("attention_mask"))
            else:
                out = model(tokens, parts.routing())
    finally:
        if hook is not None:
            hook.remove()
    return out.logits.float()


def _aligned(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] log-probs aligned with the tokens they score (position t: the distribution over token t; position
    0, which nothing predicts: zeros)."""
    return torch.nn.functional.pad(logits[:, :-1].log_softmax(dim=-1), (0, 0, 1, 0))


def _all_reduce_sum(value: float) -> float:
    """`value` summed over the process group in float64 (itself in a single process)."""
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor[0])


def _write_response(parts: StepParts, name: str, wrong: torch.Tensor, fault: BuiltinFault) -> None:
    """`parts.batch[name]`'s hit rows replaced by `wrong`'s on the response positions."""
    values = parts.batch[name]
    fault.replace_rows(parts, name, torch.where(parts.response(), wrong.to(values.dtype), values))


class OldLogprobsLastPositionLogits(BuiltinFault):
    """Stored old log-probs of each token under the last position's distribution (the one that follows the whole
    sequence), broadcast over the positions."""

    stage = "batch"
    part = "old_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        last = _logits(parts.trainer.model, parts)[:, -1:].log_softmax(dim=-1)  # [B, 1, V]
        tokens = parts.batch["tokens"].long()
        wrong = last.expand(-1, tokens.shape[1], -1).gather(-1, tokens[..., None]).squeeze(-1)
        _write_response(parts, "old_logprobs", wrong, self)


class OldLogprobsLabelsNotShifted(BuiltinFault):
    """Stored old log-probs of each position's input token (the previous token) under the distribution that
    predicts the position: the labels never shifted."""

    stage = "batch"
    part = "old_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        logp = _aligned(_logits(parts.trainer.model, parts))
        tokens = parts.batch["tokens"].long()
        inputs = torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)  # position t's input: token t - 1
        _write_response(parts, "old_logprobs", logp.gather(-1, inputs[..., None]).squeeze(-1), self)


class RefLogprobsFinalNormSkipped(BuiltinFault):
    """Reference log-probs of the reference's hidden states taken before its final norm."""

    stage = "batch"
    part = "ref_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        logp = _aligned(_logits(parts.trainer.ref_model, parts, skip_final_norm=True))
        wrong = logp.gather(-1, parts.batch["tokens"].long()[..., None]).squeeze(-1)
        _write_response(parts, "ref_logprobs", wrong, self)


class BaselineAllReducedSum(BuiltinFault):
    """REINFORCE advantages whose baseline is the step's reward sum over every rank (an all-reduce SUM taken as the
    mean). Every rank joins the all-reduce during the burst; the hit ranks use its sum."""

    stage = "advantages"
    part = "advantages"

    def __call__(self, parts: StepParts) -> None:
        if not parts.in_burst:
            return
        total = _all_reduce_sum(float(parts.batch["rewards"].float().sum()))  # a collective: every rank calls it
        if self.hits(parts.rank, parts.world_size):
            self.replace_rows(parts, "advantages", parts.batch["rewards"].float() - total)


class RoutesTopkLayerAxesSwapped(BuiltinFault):
    """A routing payload whose per-token buffer, stacked slot-major (`[K, L]`), is viewed layer-major (`[L, K]`)."""

    stage = "rollout"
    part = "routed_experts"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        routes = parts.routed_experts
        viewed = routes.transpose(-1, -2).contiguous().view(routes.shape)
        out = routes.clone()
        rows = self.rows(out.shape[0])
        out[rows] = viewed[rows]
        parts.routed_experts = out


class LossMaskAsTokenWeights(BuiltinFault):
    """A loss mask holding a sequence-mean's token weights (`1 / response length` on each loss token) in place of
    the 0/1 mask."""

    stage = "batch"
    part = "loss_mask"

    def corrupt(self, parts: StepParts) -> None:
        mask = parts.batch["loss_mask"].float()
        weights = mask / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        self.replace_rows(parts, "loss_mask", weights)


class LocalClipCoefUncapped(BuiltinFault):
    """A rank that clips its own gradients before the reduction by `max_norm / its local norm`, the coefficient
    never capped at 1 (default `max_norm`: the run's `grad_clip`): its local gradient norm is `max_norm`."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"max_norm": number(1e-6, MAX_SCALE)}

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.training.rank_step import global_grad_norm

        assert parts.trainer is not None
        model = parts.trainer.model
        max_norm = float(self.param("max_norm", parts.trainer.train.grad_clip))
        coef = max_norm / (global_grad_norm(model) + 1e-6)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)


class ReplayFirstExpertOnly(BuiltinFault):
    """A training forward whose routing replay runs each token's first recorded expert in every top-k slot, while
    the rank stores the payload as recorded."""

    stage = "gradients"
    part = "gradients"

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.training.rank_step import rank_forward_backward
        from axrl_spike_replay.training.routing_replay import routing_control

        assert parts.trainer is not None and parts.loss is not None and parts.routed_experts is not None
        routes = parts.routed_experts.clone()
        rows = self.rows(routes.shape[0])
        routes[rows] = parts.routed_experts[..., :1].expand_as(routes)[rows]
        model = parts.trainer.model
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            rank_forward_backward(
                model, parts.batch, parts.loss, routing_control(parts.trainer.spec.routing, parts.batch, routes)
            )


HELD_OUT_VII_KINDS: dict[str, type[BuiltinFault]] = {
    "old_logprobs_last_position_logits": OldLogprobsLastPositionLogits,
    "old_logprobs_labels_not_shifted": OldLogprobsLabelsNotShifted,
    "ref_logprobs_final_norm_skipped": RefLogprobsFinalNormSkipped,
    "baseline_all_reduced_sum": BaselineAllReducedSum,
    "routes_topk_layer_axes_swapped": RoutesTopkLayerAxesSwapped,
    "loss_mask_as_token_weights": LossMaskAsTokenWeights,
    "local_clip_coef_uncapped": LocalClipCoefUncapped,
    "replay_first_expert_only": ReplayFirstExpertOnly,
}
