"""Activation checkpointing per decoder layer, safe for routing replay.

Each decoder layer's forward runs under `torch.utils.checkpoint` (non-reentrant): autograd keeps only the layer's
input, and the backward runs the layer again to get what it needs. A recomputed MoE layer must route exactly as its
first forward did, or the backward would differentiate another function than the forward computed (a token near a
top-k tie may change experts between two runs of a non-deterministic kernel). So the first forward's routes are
kept with the layer's checkpoint and forced on the recompute, whatever decided them (recorded routes, the current
router, or both), with the router's weights recomputed from its logits by the architecture's own rule, as routing
replay does. A checkpointed transformers layer takes its weights from that rule in its first forward too (the same
values as the router's own), so both runs save the same tensors, as `torch.utils.checkpoint` checks.
Router logits are recorded only by the first forward: the z-loss and the aux loss count each layer once, and their
gradient reaches the router through the recompute.

The patch sets each layer's `forward` on the instance: parameter names do not change, and an FSDP2 unit's hooks
(on the module call) still gather its parameters around the forward and the recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_layers(model: nn.Module) -> int:
    """Make every decoder layer of a policy (tiny or transformers) recompute its forward in the backward, with the
    first forward's routes; the number of layers checkpointed. Idempotent."""
    from axrl_spike_replay.models.hf_policy import HFPolicy
    from axrl_spike_replay.models.tiny_moe import TinyMoEPolicy

    if isinstance(model, HFPolicy):
        model.recorder.checkpointed = True
        layers = list(model.causal_lm.model.layers)
        for index, layer in enumerate(layers):
            _patch(layer, _hf_layer(layer.forward, model, index))
        return len(layers)
    if isinstance(model, TinyMoEPolicy):
        for block in model.layers:
            _patch(block, _tiny_block(block.forward))
        return len(model.layers)
    raise TypeError(f"{type(model).__name__}: no decoder layers to checkpoint")


def is_checkpointed(layer: nn.Module) -> bool:
    """Whether `checkpoint_layers` patched this layer."""
    return getattr(layer, "_axrl_checkpointed", False)


def _patch(layer: nn.Module, forward: Callable[..., Any]) -> None:
    if is_checkpointed(layer):
        return
    object.__setattr__(layer, "forward", forward)  # the instance's forward: names and hooks unchanged
    object.__setattr__(layer, "_axrl_checkpointed", True)


def _hf_layer(original: Callable[..., Any], policy: Any, index: int) -> Callable[..., Any]:
    recorder = policy.recorder

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        first: dict[str, Any] = {}

        def run(*a: Any, **k: Any) -> Any:
            if not first:  # the forward: the hooks force and record as without checkpointing
                out = original(*a, **k)
                first["routes"] = recorder.chosen.get(index)
                return out
            with recorder.recomputing(index, first["routes"]):  # the recompute: the same routes, nothing recorded
                return original(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return forward


def _tiny_block(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(x: torch.Tensor, replay: torch.Tensor | None = None, replay_tokens: torch.Tensor | None = None) -> Any:
        if not torch.is_grad_enabled():
            return original(x, replay, replay_tokens)
        first: dict[str, Any] = {}

        def run(h: torch.Tensor) -> Any:
            if not first:
                out = original(h, replay, replay_tokens)
                first["routes"] = out[3]
                return out
            routes = first["routes"]  # a dense block has none: nothing to force
            return original(h, routes, None)

        return checkpoint(run, x, use_reentrant=False)

    return forward
