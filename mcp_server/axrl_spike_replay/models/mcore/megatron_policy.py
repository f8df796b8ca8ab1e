"""Megatron-core's own GPTModel as the policy: forward a rank's batch, force recorded routes through Megatron's
router replay, and take per-token log-probs exactly as the transformers policy takes them (`hf_policy`).

Used by the Megatron capture loop (tests, benchmarks) and by replay route 2 (`models.megatron_replay`). Needs
megatron-core; call inside `megatron_on_cpu()` on a CPU-only torch.

Routes are forced with `RouterReplay` (megatron/core/transformer/moe/router_replay.py): each router's
instance gets its layer's [S*B, K] ids (`set_target_indices`) and `REPLAY_FORWARD`, so Megatron gathers the
router's scores at those ids itself. Megatron's replay has no "no route" id; a -1 in a payload (a token the
rollout left to the current router) takes the top-k Megatron computes for that token, so each instance's
`get_replay_topk` is wrapped to merge the two. The wrapper also keeps the ids each router used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.hf_policy import response_start
from axrl_spike_replay.models.hf_routing import load_balancing_loss, router_z_loss
from axrl_spike_replay.models.mcore.megatron_gpt import causal_padding_mask, position_ids


def routers(model: Any) -> dict[int, Any]:
    """{global layer id: TopKRouter} of the model's MoE layers on this pipeline stage."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found = {}
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            router = getattr(getattr(module, "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                found[int(module.layer_number) - 1] = router
    return found


@dataclass
class RouterTrace:
    """One forward's routing: per layer the ids each router used and its logits (recomputed from its input)."""

    used: dict[int, torch.Tensor] = field(default_factory=dict)  # [S*B, K]
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # [S*B, E]


def _replay_topk(replay: Any, trace: RouterTrace, layer: int, scores: torch.Tensor, topk: int, *args: Any) -> Any:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    target = replay.target_topk_idx
    if (
        replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD
        and target is not None
        and bool((target < 0).any())
    ):
        default = args[2] if len(args) > 2 else None
        _, current = default(scores, topk, *args[:2]) if default is not None else torch.topk(scores, k=topk, dim=1)
        target = target.to(scores.device)
        ids = torch.where(target >= 0, target, current)
        probs, used = scores.gather(1, ids), ids
    else:
        probs, used = RouterReplay.get_replay_topk(replay, scores, topk, *args)
    trace.used[layer] = used.detach()
    return probs, used


def install_trace(model: Any) -> RouterTrace:
    """Wrap every router's replay instance and hook its input, so a forward leaves its routing in the trace."""
    trace = RouterTrace()
    for layer, router in routers(model).items():
        replay = router.router_replay
        if replay is None:
            raise ConfigError("the Megatron model is built without moe_enable_routing_replay: routes cannot be forced")
        replay.get_replay_topk = functools.partial(_replay_topk, replay, trace, layer)

        def hook(module: Any, args: Any, output: Any, layer: int = layer) -> None:
            hidden = args[0]
            trace.logits[layer] = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), module.weight.float())

        router.register_forward_hook(hook)
    return trace


def force_routes(model: Any, per_layer: dict[int, torch.Tensor] | None) -> None:
    """REPLAY_FORWARD with `per_layer` {global layer: [S*B, K] ids} on every router; None: Megatron routes itself
    (recording its routes when a spike guard asked it to)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, router in routers(model).items():
        replay = router.router_replay
        replay.clear_indices()
        if per_layer is None:
            if replay.router_replay_action != RouterReplayAction.RECORD:  # a trainer's recording stays on
                replay.clear_router_replay_action()
            continue
        if layer not in per_layer:
            raise ConfigError(f"the routing payload has no routes for MoE layer {layer}")
        replay.set_target_indices(per_layer[layer])
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


@dataclass
class MegatronOutput:
    """A forward's per-token log-probs [B, T] (0 before the first response position), router losses and the
    routes used [B, T, L, K] (global MoE layers in order)."""

    logprobs: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    routes: torch.Tensor


def _batch_major(t: torch.Tensor, seq: int, batch: int) -> torch.Tensor:
    """Megatron's sequence-major token rows [S*B, X] as batch-major [B*S, X] (transformers' order)."""
    return t.reshape(seq, batch, -1).transpose(0, 1).reshape(seq * batch, -1)


def megatron_logprobs(
    model: Any, trace: RouterTrace, batch: dict[str, torch.Tensor], temperature: float = 1.0
) -> MegatronOutput:
    """Forward `batch` through the GPTModel (whatever routes are forced) and take its per-token log-probs as
    `hf_logprobs` takes them: fp32 log-softmax of logits / temperature, from the first response position on."""
    tokens = batch["tokens"]
    b, s = tokens.shape
    attention = batch.get("attention_mask")
    trace.used.clear()
    trace.logits.clear()
    logits = model(tokens, position_ids(attention, b, s), causal_padding_mask(attention, b, s))
    start = response_start(batch["loss_mask"])
    shifted = logits[:, start - 1 : -1].float()
    if temperature != 1.0:
        shifted = shifted / temperature
    logp = F.pad(shifted.log_softmax(dim=-1).gather(-1, tokens[:, start:, None]).squeeze(-1), (start, 0))
    layers = sorted(trace.used)
    if layers:
        experts = trace.logits[layers[0]].shape[-1]
        logits_bm = [_batch_major(trace.logits[i], s, b) for i in layers]
        chosen = [_batch_major(trace.used[i], s, b) for i in layers]
        aux = load_balancing_loss(logits_bm, chosen, experts, attention)
        z_loss = router_z_loss(logits_bm)
        routes = torch.stack([c.reshape(b, s, -1) for c in chosen], dim=2)
    else:
        aux = z_loss = logits.new_zeros((), dtype=torch.float32)
        routes = tokens.new_zeros((b, s, 0, 1))
    return MegatronOutput(logprobs=logp, aux_loss=aux, z_loss=z_loss, routes=routes)
