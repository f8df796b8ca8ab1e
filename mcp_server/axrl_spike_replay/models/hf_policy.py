"""A transformers MoE causal LM as a policy: forward with routing replay, and per-token log-probs as RL trainers
compute them (position ids from the attention mask, `logits_to_keep`, temperature before the log-softmax).

`HFPolicy` registers the causal LM's children as its own, so its parameter and state names are exactly
transformers' (`model.layers.0.mlp.gate.weight`, `lm_head.weight`): checkpoints and grad-norm tables use them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.chunked_head import ChunkedHead, HeadRequest, as_chunked_head
from axrl_spike_replay.models.hf_config import HFModelConfig, instantiate
from axrl_spike_replay.models.hf_routing import (
    RouteRecorder,
    find_routers,
    install_route_hooks,
    load_balancing_loss,
    router_z_loss,
)
from axrl_spike_replay.models.tiny_moe import ModelOutput, RoutingControl, head_output

# transformers' experts kernels that forward-mode AD runs through; `grouped_mm` (a custom op) has no forward-AD formula
FORWARD_AD_EXPERTS = ("eager", "batched_mm")


@contextmanager
def experts_for_forward_ad(model: nn.Module) -> Iterator[str | None]:
    """Within: a transformers policy computes its experts with a kernel forward-mode AD runs through.

    transformers' `grouped_mm` experts (route 1's default for Megatron snapshots, `models.mcore.megatron_config`) have
    no forward-AD formula: a forward-mode pass through them raises NotImplementedError. Such a policy computes its
    experts eagerly inside, the same function in another summation order, and gets its kernel back after. Yields the
    kernel it switched from; None when nothing was switched (not a transformers policy, or already such a kernel)."""
    causal_lm: Any = model.causal_lm if isinstance(model, HFPolicy) else None
    if causal_lm is None or not hasattr(causal_lm, "get_experts_implementation"):
        yield None
        return
    before: dict[str, str | None] = causal_lm.get_experts_implementation()
    if all(kernel is None or kernel in FORWARD_AD_EXPERTS for kernel in before.values()):
        yield None
        return
    causal_lm.set_experts_implementation("eager")
    try:
        yield before.get("")
    finally:
        causal_lm.set_experts_implementation(before)


class HFPolicy(nn.Module):
    """The spec's causal LM with a routing hook on every router; `forward` mirrors `TinyMoEPolicy.forward`."""

    causal_lm: Any  # a transformers PreTrainedModel (typed loosely: transformers is an optional dependency)

    def __init__(self, spec: HFModelConfig, device: str = "cpu") -> None:
        super().__init__()
        self.spec = spec
        causal_lm: Any = instantiate(spec, device)
        object.__setattr__(self, "causal_lm", causal_lm)  # not a submodule: its children are ours, names unprefixed
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        as_chunked_head(causal_lm.lm_head)  # the same module (`lm_head.weight`), its call also taking targets
        self.moe_layer_ids = tuple(sorted(find_routers(causal_lm, spec.architecture)))
        self.n_layers = len(causal_lm.model.layers)
        routers: list[Any] = list(find_routers(causal_lm, spec.architecture).values())
        self.n_experts = int(routers[0].num_experts) if routers else 0
        self.recorder = RouteRecorder()
        install_route_hooks(causal_lm, spec.architecture, self.recorder)

    @property
    def head(self) -> ChunkedHead:
        """The output head (`lm_head`), chunked."""
        return cast(ChunkedHead, self.causal_lm.lm_head)

    def forced_routes(self, routing: RoutingControl, batch: int, seq: int) -> dict[int, torch.Tensor]:
        """{absolute layer: [B*T, K] forced ids (-1: current)} from the control's recorded routes."""
        if routing.routes is None:
            return {}
        routes = routing.routes
        slots = routes.shape[2]
        if routes.dim() != 4 or routes.shape[:2] != (batch, seq):
            raise ConfigError(f"routing payload shape {tuple(routes.shape)} does not fit the batch [{batch}, {seq}]")
        # The payload lists MoE layers in order; a payload with one slot per decoder layer is indexed absolutely.
        if slots == len(self.moe_layer_ids):
            layer_slot = dict(zip(self.moe_layer_ids, range(slots), strict=True))
        elif slots == self.n_layers:
            layer_slot = {layer: layer for layer in self.moe_layer_ids}
        else:
            raise ConfigError(
                f"routing payload has {slots} layers; the model has {len(self.moe_layer_ids)} MoE layers "
                f"(of {self.n_layers} decoder layers)"
            )
        forced = {}
        for layer, slot in layer_slot.items():
            if layer in routing.current_layers:
                continue
            ids = routes[:, :, slot, :].long()
            if routing.replay_tokens is not None:
                ids = torch.where(routing.replay_tokens[..., None].to(ids.device), ids, torch.full_like(ids, -1))
            forced[layer] = ids.reshape(batch * seq, -1)
        return forced

    def forward(
        self,
        tokens: torch.Tensor,
        routing: RoutingControl | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        head: HeadRequest | None = None,
    ) -> ModelOutput:
        """Logits (the last `logits_to_keep` positions, all when 0), router losses from the routes used, routes;
        with a `head` request, the chunked head's log-probs (and entropies) instead of the logits.

        The decoder runs as transformers' causal LM runs it (`model.model`), then the head on its last hidden
        state, as the causal LM's own forward does for the supported architectures (none scales its logits)."""
        routing = routing or RoutingControl()
        batch, seq = tokens.shape
        self.recorder.reset(self.forced_routes(routing, batch, seq))
        mask = attention_mask if attention_mask is not None else torch.ones_like(tokens)
        # left-padded prompts: positions count real tokens only, as RL trainers compute them
        position_ids = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        decoded = self.causal_lm.model(
            input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        out_logits, logprobs, entropy = head_output(self.head, decoded.last_hidden_state, tokens, head, logits_to_keep)
        layers = sorted(self.recorder.logits)
        logits = [self.recorder.logits[i] for i in layers]
        chosen = [self.recorder.chosen[i] for i in layers]
        self.recorder.reset({})
        if logits:
            aux = load_balancing_loss(logits, chosen, self.n_experts, attention_mask)
            z_loss = router_z_loss(logits)
            routes = torch.stack([c.reshape(batch, seq, -1) for c in chosen], dim=2)
        else:
            aux = z_loss = decoded.last_hidden_state.new_zeros((), dtype=torch.float32)
            routes = tokens.new_zeros((batch, seq, 0, 1))
        return ModelOutput(out_logits, aux, z_loss, routes, logprobs, entropy)


def response_start(loss_mask: torch.Tensor) -> int:
    """First position any sample takes a loss at (at least 1: position 0 has no prefix to predict it)."""
    positions = torch.nonzero(loss_mask.reshape(loss_mask.shape[0], -1).sum(dim=0) > 0)
    return max(1, int(positions[0, 0])) if positions.numel() else loss_mask.shape[-1] - 1


def hf_logprobs(
    model: HFPolicy, batch: dict[str, Any], routing: RoutingControl, need_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, ModelOutput]:
    """[B, T] log-probs (and entropies) of the tokens from the first response position on; 0 before it.

    The head runs in chunks of tokens (`models.chunked_head`) over the positions that predict response tokens only,
    its logits divided by the temperature before the log-softmax in fp32: no [T, V] float32 tensor is held.
    """
    tokens = batch["tokens"]
    request = HeadRequest(response_start(batch["loss_mask"]), float(model.spec.temperature), need_entropy)
    out = model(tokens, routing, attention_mask=batch.get("attention_mask"), head=request)
    return cast(torch.Tensor, out.logprobs), out.entropy, out  # a head request always gives log-probs
