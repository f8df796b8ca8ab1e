"""A tenth set of held-out trainer bugs: kinds no preset and no `held_out`, `unseen`, `held_out_ii` ... `held_out_ix`
case uses, written and committed before any diagnosis was run on them.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run
config or the log (`capture_reference_run(hide_fault=True)`). Four are in the data the rank's step consumes (the
snapshot stores it as consumed), two in what the trainer does with it (`gradients` stage: the snapshot stores the
batch and weights the step should have used):

- `old_logprobs_context_parallel_unrestored`: the old-log-prob pass runs with context parallelism (`cp` ranks, the
  load-balanced split of each sequence into `2 cp` chunks, rank r holding chunks r and 2 cp - 1 - r) and all-gathers
  its log-probs without undoing that split: each position gets the old log-prob of a position in another chunk (or
  the split's zero padding);
- `routes_topk_ascending`: the engine's routing capture takes its top-k from an ascending sort of the router scores
  (`sort()[..., :k]`, the default order): every token's recorded experts are the ones its router scores lowest;
- `rollout_logprobs_reversed`: the engine client collects each response's per-token log-probs back to front (each
  new entry put first, as a client that walks the streamed output from its end does): the first response token gets
  the last one's engine log-prob, and so on, while the tokens keep their order;
- `rollout_logprobs_tp_shard_swapped`: the engine's sampler gathers each sampled token's log-prob from its
  vocabulary-parallel log-softmax with the next tensor-parallel rank's shard offset (`tp` ranks): every token is
  scored at the id `vocab / tp` away, a token the engine did not sample;
- `train_forward_embedding_multiplier`: one rank's training forward multiplies its token embeddings by
  `multiplier` (default the square root of the hidden size, the scale a Gemma-style embedding applies, switched on by
  a model flag only that rank's training build reads), a scale the model's own forward (the rollout's, the
  old-log-prob pass's) never applies;
- `expert_local_index_off_by_one`: one expert-parallel rank's training forward maps each global expert id to its
  local expert one `offset` on (a shard offset counted from 1): a token routed to expert e, gated as e, is computed
  by expert e + 1's weights, which take its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import ParamRule, number, whole


def context_parallel_order(length: int, cp: int) -> torch.Tensor:
    """[length] index into a sequence padded to a multiple of `2 cp`: the position each gathered slot holds when the
    `cp` ranks' load-balanced chunks (rank r: chunks r and 2 cp - 1 - r) are concatenated in rank order, the split
    never undone. An index at or past `length` is the split's padding."""
    chunks = 2 * cp
    padded = math.ceil(length / chunks) * chunks
    size = padded // chunks
    order = [c for r in range(cp) for c in (r, chunks - 1 - r)]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in order])[:length]


def context_parallel_unrestored(values: torch.Tensor, cp: int) -> torch.Tensor:
    """[B, T] values as a context-parallel gather leaves them without its reorder (`context_parallel_order`; the
    padding reads 0)."""
    length = values.shape[1]
    order = context_parallel_order(length, cp)
    padded = torch.zeros((values.shape[0], int(order.max()) + 1), dtype=values.dtype)
    padded[:, :length] = values
    return padded[:, order]


class OldLogprobsContextParallelUnrestored(BuiltinFault):
    """Old log-probs all-gathered from a `cp`-way (default 2) load-balanced context-parallel pass, never reordered."""

    stage = "batch"
    part = "old_logprobs"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"cp": whole(2, 64)}

    def corrupt(self, parts: StepParts) -> None:
        values = parts.batch["old_logprobs"]
        self.replace_rows(parts, "old_logprobs", context_parallel_unrestored(values, int(self.param("cp", 2))))


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The policy's router modules, one per MoE layer in layer order (tiny_moe's `ffn.router`, a transformers
    model's routers as `models.hf_routing` finds them)."""
    from axrl_spike_replay.models.hf_policy import HFPolicy
    from axrl_spike_replay.models.hf_routing import find_routers
    from axrl_spike_replay.models.tiny_moe import MoEFeedForward, TinyMoEPolicy

    if isinstance(model, HFPolicy):
        routers = find_routers(model.causal_lm, model.spec.architecture)
        return [routers[layer] for layer in sorted(routers)]
    assert isinstance(model, TinyMoEPolicy)
    return [block.ffn.router for block in model.layers if isinstance(block.ffn, MoEFeedForward)]


def router_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T, L_moe, E] each MoE layer's router scores of `batch`'s tokens, routed on the policy's own scores."""
    from axrl_spike_replay.models.policy import policy_forward
    from axrl_spike_replay.models.tiny_moe import RoutingControl

    tokens = batch["tokens"]
    seen: list[torch.Tensor] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        seen.append(logits.detach().float().reshape(tokens.shape[0], tokens.shape[1], -1))

    handles = [router.register_forward_hook(keep) for router in moe_routers(model)]
    try:
        with torch.no_grad():
            policy_forward(model, batch, RoutingControl(), need_entropy=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(seen, dim=2)


class RoutesTopkAscending(BuiltinFault):
    """A routing payload whose top-k comes from an ascending sort: each token's k lowest-scored experts per layer."""

    stage = "rollout"
    part = "routed_experts"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None and parts.routed_experts is not None
        routes = parts.routed_experts
        scores = router_scores(parts.trainer.model, parts.batch)
        lowest = scores.sort(dim=-1).indices[..., : routes.shape[-1]].to(routes.dtype)
        out = routes.clone()
        rows = self.rows(routes.shape[0])
        out[rows] = lowest[rows]
        parts.routed_experts = out


def reversed_response(values: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, T] values with each row's response positions (from `prompt_len` on) in reverse order, the prompt's kept:
    the first response token gets the last one's value."""
    return torch.cat([values[:, :prompt_len], values[:, prompt_len:].flip(1)], dim=1)


class RolloutLogprobsReversed(BuiltinFault):
    """Engine log-probs collected back to front over each response (`reversed_response`)."""

    stage = "rollout"
    part = "rollout_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        values = parts.batch["rollout_logprobs"]
        self.replace_rows(parts, "rollout_logprobs", reversed_response(values, parts.prompt_len))


def shard_swapped_ids(tokens: torch.Tensor, vocab_size: int, tp: int) -> torch.Tensor:
    """[B, T] the id each token's log-prob is gathered at when a `tp`-way vocabulary-parallel gather subtracts the
    next rank's shard offset: one shard (`vocab_size / tp` ids) on, modulo the vocabulary."""
    return (tokens + vocab_size // tp) % vocab_size


class RolloutLogprobsTpShardSwapped(BuiltinFault):
    """Engine log-probs gathered one vocabulary shard on (`shard_swapped_ids`, `tp` default 2): each token's entry is
    the engine's log-prob of the id `vocab / tp` away, from the full (all-reduced) log-softmax."""

    stage = "rollout"
    part = "rollout_logprobs"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"tp": whole(2, 64)}

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.capture.reference.rollout import rollout_engine
        from axrl_spike_replay.models.tiny_moe import token_logprobs

        assert parts.trainer is not None
        tokens = parts.batch["tokens"]
        with torch.no_grad():
            logits = rollout_engine(parts.trainer.rollout_policy())(tokens).logits.float()
        ids = shard_swapped_ids(tokens, logits.shape[-1], int(self.param("tp", 2)))
        values = torch.where(parts.response(), token_logprobs(logits, ids), parts.batch["rollout_logprobs"])
        self.replace_rows(parts, "rollout_logprobs", values)


def input_embedding(model: nn.Module) -> nn.Module:
    """The policy's token embedding (tiny_moe's `embed`, a transformers model's input embeddings)."""
    from axrl_spike_replay.models.hf_policy import HFPolicy

    if isinstance(model, HFPolicy):
        return model.causal_lm.get_input_embeddings()
    embed = getattr(model, "embed", None)
    assert isinstance(embed, nn.Module), f"{type(model).__name__} has no token embedding"
    return embed


def _train_backward(parts: StepParts) -> None:
    """The rank's forward and backward on its own batch, its gradients first cleared (the fault's forward)."""
    from axrl_spike_replay.training.rank_step import rank_forward_backward

    assert parts.trainer is not None and parts.loss is not None
    model = parts.trainer.model
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        rank_forward_backward(model, parts.batch, parts.loss, parts.routing())


class TrainForwardEmbeddingMultiplier(BuiltinFault):
    """A rank whose training forward scales its token embeddings by `multiplier` (default sqrt(hidden size)); its
    snapshot stores the batch and weights as they are."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"multiplier": number(1e-3, 1e6)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        embed = input_embedding(parts.trainer.model)
        weight = getattr(embed, "weight")  # noqa: B009 - an nn.Embedding's table
        multiplier = float(self.param("multiplier", math.sqrt(weight.shape[1])))

        def scaled(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            return output * multiplier

        handle = embed.register_forward_hook(scaled)
        try:
            _train_backward(parts)
        finally:
            handle.remove()


def expert_weights(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' stacked weights, expert on the first axis (tiny_moe's `ffn.w_in` / `ffn.w_out`, a
    transformers model's `mlp.experts.*`; a shared expert is not among them)."""
    return [
        p for name, p in model.named_parameters() if ".experts." in name or name.endswith(("ffn.w_in", "ffn.w_out"))
    ]


@contextmanager
def experts_rolled(weights: list[nn.Parameter], offset: int) -> Iterator[None]:
    """While inside: slot e of each stacked expert weight holds expert e + `offset`'s weights; on leaving, the
    weights are put back and each gradient moved onto the expert whose weights computed it."""
    with torch.no_grad():
        saved = [p.detach().clone() for p in weights]
        for p in weights:
            p.copy_(p.roll(-offset, dims=0))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, original in zip(weights, saved, strict=True):
                p.copy_(original)
                if p.grad is not None:
                    p.grad = p.grad.roll(offset, dims=0)


class ExpertLocalIndexOffByOne(BuiltinFault):
    """A rank whose training forward computes each routed expert e with expert e + `offset`'s weights (default 1,
    modulo the expert count), gated as e; those weights take the gradient."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"offset": whole(1, 4096)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        weights = expert_weights(parts.trainer.model)
        assert weights, "the policy has no stacked expert weights"
        with experts_rolled(weights, int(self.param("offset", 1))):
            _train_backward(parts)


HELD_OUT_X_KINDS: dict[str, type[BuiltinFault]] = {
    "old_logprobs_context_parallel_unrestored": OldLogprobsContextParallelUnrestored,
    "routes_topk_ascending": RoutesTopkAscending,
    "rollout_logprobs_reversed": RolloutLogprobsReversed,
    "rollout_logprobs_tp_shard_swapped": RolloutLogprobsTpShardSwapped,
    "train_forward_embedding_multiplier": TrainForwardEmbeddingMultiplier,
    "expert_local_index_off_by_one": ExpertLocalIndexOffByOne,
}
