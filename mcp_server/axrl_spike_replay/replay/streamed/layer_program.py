"""A policy's forward cut at its decoder layers, for a streamed replay: the embedding, one layer, the head.

`policy_forward` runs a policy whole; a streamed replay runs the same computation in pieces, one decoder layer at a
time over every micro-batch, with the layer boundaries kept in between. Each piece is the policy's own module
called as its forward calls it, so the pieces compose to the whole forward:

- tiny_moe: `embed + pos`, each `Block` with that MoE layer's recorded routes, `norm` and the chunked head; the
  router losses summed over layers as `TinyMoEPolicy.forward` sums them.
- transformers: the decoder model run with its layers stood in for by pass-throughs gives the embedding and each
  layer's own call arguments (position embeddings, the layer type's attention mask), as transformers computes
  them; each layer is then called with them, routes forced through the policy's routing hooks; the final norm,
  the chunked head (`hf_logprobs`' request) and the router losses from every layer's logits
  (`load_balancing_loss`, `router_z_loss`).

What a layer hands on besides its hidden states (`LayerOut.extras`) is what the loss reads of it: the tiny block's
aux and z losses, a transformers router's logits. Its routes (`chosen`) are forced again when the backward
recomputes it, as a checkpointed layer's are (`models.layer_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.chunked_head import HeadRequest
from axrl_spike_replay.models.policy import PolicyOutput
from axrl_spike_replay.models.tiny_moe import MoEFeedForward, RoutingControl, TinyMoEPolicy, head_output


@dataclass
class LayerOut:
    """A decoder layer's output on one micro-batch: hidden states, what the loss reads of it, the routes it took."""

    hidden: torch.Tensor
    extras: tuple[torch.Tensor, ...]
    chosen: torch.Tensor | None


class LayerProgram:
    """The pieces of a policy's forward (see the module docstring); `for_policy` picks the model kind's."""

    layers: Sequence[nn.Module]

    def embed(self, batch: dict[str, Any]) -> torch.Tensor:
        """The first decoder layer's input hidden states."""
        raise NotImplementedError

    def run_layer(
        self, index: int, hidden: torch.Tensor, batch: dict[str, Any], routing: RoutingControl, forced: Any
    ) -> LayerOut:
        """Decoder layer `index` on `hidden` with `routing`'s recorded routes, or `forced` (its first forward's)."""
        raise NotImplementedError

    def head(
        self,
        hidden: torch.Tensor,
        batch: dict[str, Any],
        extras: Sequence[tuple[torch.Tensor, ...]],
        chosen: Sequence[torch.Tensor | None],
        need_entropy: bool,
    ) -> PolicyOutput:
        """Log-probs, entropies and router losses from the last layer's hidden states and every layer's extras."""
        raise NotImplementedError

    def end_modules(self) -> list[nn.Module]:
        """The modules outside the decoder layers (embedding, final norm, head), held through the whole replay."""
        raise NotImplementedError

    def embed_modules(self) -> list[nn.Module]:
        """The modules `embed` computes with (the rest of `end_modules` are the head's)."""
        raise NotImplementedError


class TinyProgram(LayerProgram):
    """`TinyMoEPolicy.forward` in pieces."""

    def __init__(self, policy: TinyMoEPolicy) -> None:
        self.policy = policy
        self.layers = policy.layers
        self.slots: dict[int, int] = {}
        for index, block in enumerate(policy.layers):
            if isinstance(block.ffn, MoEFeedForward):
                self.slots[index] = len(self.slots)

    def embed(self, batch: dict[str, Any]) -> torch.Tensor:
        tokens = batch["tokens"]
        seq = tokens.shape[1]
        if seq > self.policy.cfg.max_seq_len:
            raise ConfigError(f"sequence length {seq} exceeds model.max_seq_len {self.policy.cfg.max_seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        return self.policy.embed(tokens) + self.policy.pos(positions)[None]

    def run_layer(
        self, index: int, hidden: torch.Tensor, batch: dict[str, Any], routing: RoutingControl, forced: Any
    ) -> LayerOut:
        block = self.policy.layers[index]
        replay, tokens = None, routing.replay_tokens
        if forced is not None:
            replay, tokens = forced, None
        elif index in self.slots and routing.routes is not None and index not in routing.current_layers:
            replay = routing.routes[:, :, self.slots[index], :].to(hidden.device)
        out, aux, z_loss, chosen = block(hidden, replay, tokens)
        extras = (aux, z_loss) if aux is not None and z_loss is not None else ()
        return LayerOut(out, extras, chosen)

    def head(
        self,
        hidden: torch.Tensor,
        batch: dict[str, Any],
        extras: Sequence[tuple[torch.Tensor, ...]],
        chosen: Sequence[torch.Tensor | None],
        need_entropy: bool,
    ) -> PolicyOutput:
        tokens = batch["tokens"]
        zero = hidden.new_zeros((), dtype=torch.float32)
        aux_total, z_total = zero, zero
        for layer in extras:
            if layer:
                aux_total, z_total = aux_total + layer[0], z_total + layer[1]
        _, logprobs, entropy = head_output(
            self.policy.head, self.policy.norm(hidden), tokens, HeadRequest(1, 1.0, need_entropy)
        )
        routes = [c for c in chosen if c is not None]
        batch_size, seq = tokens.shape
        stacked = (
            torch.stack(routes, dim=2) if routes else tokens.new_zeros((batch_size, seq, 0, self.policy.cfg.top_k))
        )
        assert logprobs is not None  # a head request always gives log-probs
        return PolicyOutput(logprobs, entropy, aux_total, z_total, stacked)

    def end_modules(self) -> list[nn.Module]:
        return [self.policy.embed, self.policy.pos, self.policy.norm, self.policy.head]

    def embed_modules(self) -> list[nn.Module]:
        return [self.policy.embed, self.policy.pos]


class _PassThrough(nn.Module):
    """Stands in for a decoder layer: keeps the call's arguments, hands the hidden states on unchanged."""

    def __init__(self, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        super().__init__()
        self.calls = calls

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append((args, kwargs))
        return hidden


class HFProgram(LayerProgram):
    """`HFPolicy.forward` (with `hf_logprobs`' head request) in pieces."""

    def __init__(self, policy: Any) -> None:
        self.policy: Any = policy
        self.lm: Any = policy.causal_lm
        self.layers = list(self.lm.model.layers)
        self.policy.recorder.checkpointed = True  # the forward and the recompute weigh routes by the same rule

    @contextmanager
    def _passing(self, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Iterator[None]:
        decoder = self.lm.model
        layers = decoder.layers
        decoder.layers = nn.ModuleList([_PassThrough(calls) for _ in layers])
        try:
            yield
        finally:
            decoder.layers = layers

    def _calls(self, batch: dict[str, Any]) -> tuple[torch.Tensor, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
        """(the embedding, each layer's call arguments) of the decoder model's own forward on `batch`."""
        tokens = batch["tokens"]
        attention_mask = batch.get("attention_mask")
        mask = attention_mask if attention_mask is not None else torch.ones_like(tokens)
        position_ids = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # as `HFPolicy.forward`
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        first: list[torch.Tensor] = []

        def keep_input(module: nn.Module, args: tuple[Any, ...]) -> None:
            first.append(args[0])

        with self._passing(calls):
            handle = self.lm.model.layers[0].register_forward_pre_hook(keep_input)
            try:
                self.lm.model(
                    input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                )
            finally:
                handle.remove()
        return first[0], calls

    def embed(self, batch: dict[str, Any]) -> torch.Tensor:
        return self._calls(batch)[0]

    def run_layer(
        self, index: int, hidden: torch.Tensor, batch: dict[str, Any], routing: RoutingControl, forced: Any
    ) -> LayerOut:
        with torch.no_grad():
            _, calls = self._calls(batch)
        args, kwargs = calls[index]
        recorder = self.policy.recorder
        tokens = batch["tokens"]
        if forced is not None:
            recorder.reset({index: forced})
        else:
            recorder.reset(self.policy.forced_routes(routing, tokens.shape[0], tokens.shape[1]))
        try:
            out = self.layers[index](hidden, *args, **kwargs)
            logits, chosen = recorder.logits.get(index), recorder.chosen.get(index)
        finally:
            recorder.reset({})
        out = out[0] if isinstance(out, tuple) else out
        return LayerOut(out, (logits,) if logits is not None else (), chosen)

    def head(
        self,
        hidden: torch.Tensor,
        batch: dict[str, Any],
        extras: Sequence[tuple[torch.Tensor, ...]],
        chosen: Sequence[torch.Tensor | None],
        need_entropy: bool,
    ) -> PolicyOutput:
        from axrl_spike_replay.models.hf_policy import response_start
        from axrl_spike_replay.models.hf_routing import load_balancing_loss, router_z_loss

        tokens = batch["tokens"]
        batch_size, seq = tokens.shape
        request = HeadRequest(response_start(batch["loss_mask"]), float(self.policy.spec.temperature), need_entropy)
        normed = self.lm.model.norm(hidden)
        _, logprobs, entropy = head_output(self.policy.head, normed, tokens, request)
        logits = [layer[0] for layer in extras if layer]
        routes = [c for c in chosen if c is not None]
        if logits:
            aux = load_balancing_loss(logits, routes, self.policy.n_experts, batch.get("attention_mask"))
            z_loss = router_z_loss(logits)
            stacked = torch.stack([c.reshape(batch_size, seq, -1) for c in routes], dim=2)
        else:
            aux = z_loss = normed.new_zeros((), dtype=torch.float32)
            stacked = tokens.new_zeros((batch_size, seq, 0, 1))
        assert logprobs is not None  # a head request always gives log-probs
        return PolicyOutput(logprobs, entropy, aux, z_loss, stacked)

    def end_modules(self) -> list[nn.Module]:
        decoder = self.lm.model
        return [m for name, m in decoder.named_children() if name != "layers"] + [self.lm.lm_head]

    def embed_modules(self) -> list[nn.Module]:
        return [self.lm.model.embed_tokens]


def for_policy(policy: nn.Module) -> LayerProgram:
    """The layer program of a built policy (tiny_moe or transformers)."""
    from axrl_spike_replay.models.hf_policy import HFPolicy

    if isinstance(policy, HFPolicy):
        return HFProgram(policy)
    if isinstance(policy, TinyMoEPolicy):
        return TinyProgram(policy)
    raise ConfigError(f"{type(policy).__name__}: no decoder layers to stream")
