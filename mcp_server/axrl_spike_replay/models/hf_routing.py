"""Routing replay (R3) on transformers' MoE routers: recorded expert ids forced through a forward hook.

In transformers 5 every router of the supported architectures returns `(router_logits, topk_weights,
topk_indices)`. The hook keeps the logits, swaps in the recorded indices and recomputes the weights from the
current logits with the architecture's own rule (`models.architectures`), so the router keeps its gradient. With
no replay the router's output is passed through untouched, so forcing a token's own routes reproduces the
forward bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.architectures import ARCHITECTURES


def find_routers(model: nn.Module, architecture: str) -> dict[int, nn.Module]:
    """{absolute decoder layer: router module} for the layers that route (dense layers have none): each layer's
    `mlp.<router>` as the architecture declares it (`models.architectures`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"{type(model).__name__}: no decoder layers at model.layers")
    name = ARCHITECTURES[architecture].router
    routers: dict[int, nn.Module] = {}
    for index, layer in enumerate(layers):
        router = getattr(getattr(layer, "mlp", None), name, None)
        if isinstance(router, nn.Module) and type(router).__name__.endswith("Router"):
            routers[index] = router
    return routers


@dataclass
class RouteRecorder:
    """One forward's routing: what to force (set before the forward) and what each router did (filled by the hooks).

    `forced` {layer: [N, K] expert ids, -1 = current}; `logits` / `chosen` {layer: [N, E] / [N, K]}.
    """

    forced: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)
    # a checkpointed layer's recompute (`models.layer_checkpoint`): {layer: its first forward's routes}, forced again,
    # and nothing recorded
    recompute: dict[int, torch.Tensor] = field(default_factory=dict)
    # layers are checkpointed: every route goes through the weight rule, in the forward as in the recompute, so the
    # two save the same tensors even where a router would choose otherwise the second time
    checkpointed: bool = False

    def reset(self, forced: dict[int, torch.Tensor]) -> None:
        self.forced, self.logits, self.chosen = forced, {}, {}

    @contextlib.contextmanager
    def recomputing(self, layer: int, routes: torch.Tensor | None) -> Iterator[None]:
        """While a checkpointed layer recomputes: force `routes` (its first forward's) and record nothing."""
        if routes is not None:
            self.recompute[layer] = routes
        try:
            yield
        finally:
            self.recompute.pop(layer, None)


def install_route_hooks(model: nn.Module, architecture: str, recorder: RouteRecorder) -> list[Any]:
    """A forward hook on every router that forces `recorder.forced[layer]` and records logits and routes."""
    rule = ARCHITECTURES[architecture].weight_rule
    handles = []
    for layer, router in find_routers(model, architecture).items():

        def hook(module: nn.Module, args: Any, output: Any, layer: int = layer) -> Any:
            logits, weights, chosen = output
            again = recorder.recompute.get(layer)
            if again is not None:  # a checkpointed layer's recompute: the first forward's routes, not recorded
                routes = again.to(chosen.device)
                return logits, rule(module, logits, routes), routes
            forced = recorder.forced.get(layer)
            if forced is None and recorder.checkpointed:  # the rule's weights in both runs of a checkpointed layer
                forced = torch.full_like(chosen, -1)
            if forced is not None:
                forced = forced.to(chosen.device)
                chosen = torch.where(forced >= 0, forced.clamp(min=0), chosen)
                weights = rule(module, logits, chosen)
            recorder.logits[layer] = logits
            recorder.chosen[layer] = chosen
            return (logits, weights, chosen) if forced is not None else output

        handles.append(router.register_forward_hook(hook))
    return handles


def load_balancing_loss(
    logits: list[torch.Tensor], chosen: list[torch.Tensor], num_experts: int, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """transformers' `load_balancing_loss_func`, counting the experts the forward used (the forced ones)
    instead of re-deriving top-k from the logits, which would ignore the replayed routes."""
    device = logits[0].device
    tokens_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows: torch.Tensor | float = 0.0
    flat = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_logits, layer_chosen in zip(logits, chosen, strict=True):
        probs = torch.nn.functional.softmax(layer_logits, dim=-1)
        top_k = layer_chosen.shape[-1]
        if flat is None:
            tokens_sum = tokens_sum + torch.histc(
                layer_chosen.reshape(-1).float(), bins=num_experts, min=0, max=num_experts
            )
            prob_sum = prob_sum + probs.float().sum(dim=0)
            rows = rows + probs.shape[0]
        else:
            tokens_sum = tokens_sum + torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(
                0, layer_chosen.reshape(-1), flat.repeat_interleave(top_k)
            )
            prob_sum = prob_sum + (probs.float() * flat.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat.sum()
    return torch.sum((tokens_sum / rows) * (prob_sum / rows).unsqueeze(0)) * num_experts


def router_z_loss(logits: list[torch.Tensor]) -> torch.Tensor:
    """Router z-loss summed over MoE layers (mean over tokens of logsumexp²), as the tiny model defines it."""
    total = logits[0].new_zeros((), dtype=torch.float32)
    for layer_logits in logits:
        total = total + torch.logsumexp(layer_logits.float(), dim=-1).pow(2).mean()
    return total
