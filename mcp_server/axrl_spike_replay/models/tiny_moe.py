"""A tiny MoE decoder policy (pure torch) whose routing can be recorded and replayed.

Replayed routing (R3) takes the expert indices from a routing payload while the gate weights
still come from the current router scores, so the router keeps its gradient.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.chunked_head import ChunkedHead, HeadRequest, sequence_logprobs

# Limits on the `model:` section of a run config we did not write, checked before anything is built:
# the torch backend rebuilds a *tiny* policy, and every dimension must also match the checkpoint's
# tensors (bounded by the bytes of its data files), so these only stop absurd values early.
MODEL_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 20,
    "d_model": 1 << 16,
    "n_layers": 1024,
    "n_heads": 1024,
    "d_ff": 1 << 18,
    "n_experts": 4096,
    "top_k": 4096,
    "max_seq_len": 1 << 20,
}
MAX_MODEL_PARAMETERS = 1 << 33  # 8G parameters (32 GB in fp32): far beyond a tiny replay model


@dataclass(frozen=True)
class TinyMoEConfig:
    vocab_size: int = 16
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    d_ff: int = 64
    n_experts: int = 4
    top_k: int = 2
    max_seq_len: int = 32
    moe_layers: tuple[int, ...] | None = None  # None: every layer is MoE

    def __post_init__(self) -> None:
        for name, limit in MODEL_LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"model.{name} must be an integer, got {type(value).__name__} {shown(value, 40)}")
            if not 1 <= value <= limit:
                raise ConfigError(f"model.{name} must be in [1, {limit}], got {shown(value, 40)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"model.top_k ({self.top_k}) must be in [1, n_experts={self.n_experts}]")
        if self.moe_layers is not None:
            if not isinstance(self.moe_layers, tuple) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in self.moe_layers
            ):
                raise ConfigError(f"model.moe_layers must be a list of layer ids, got {shown(self.moe_layers, 80)}")
            if len(set(self.moe_layers)) != len(self.moe_layers):
                raise ConfigError(f"model.moe_layers repeats a layer id: {shown(list(self.moe_layers), 80)}")
        for layer in self.moe_layer_ids:
            if not 0 <= layer < self.n_layers:
                raise ConfigError(f"model.moe_layers has {layer}, outside [0, {self.n_layers})")
        parameters = sum(_numel(shape) for shape in expected_state_shapes(self).values())
        if parameters > MAX_MODEL_PARAMETERS:
            raise ConfigError(
                f"model: {parameters} parameters, more than the {MAX_MODEL_PARAMETERS} limit of the tiny replay model"
            )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.n_layers)) if self.moe_layers is None else tuple(self.moe_layers)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["moe_layers"] = list(self.moe_layer_ids)
        return {"kind": "tiny_moe", **doc}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> TinyMoEConfig:
        """Build from the `model:` section of a run config; unknown keys and bad types are a ConfigError."""
        if not isinstance(doc, dict):
            raise ConfigError(f"model: expected a mapping, got {type(doc).__name__}")
        values = {k: v for k, v in doc.items() if k != "kind"}
        if doc.get("kind", "tiny_moe") != "tiny_moe":
            raise ConfigError(
                f"model.kind {shown(doc.get('kind'), 60)} is not built in (the torch backend builds 'tiny_moe')"
            )
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(str(k) for k in set(values) - known)
        if unknown:
            raise ConfigError(f"model: unknown keys {shown_names(unknown)} (known: {sorted(known)})")
        layers = values.get("moe_layers")
        if layers is not None:
            if not isinstance(layers, (list, tuple)) or len(layers) > MODEL_LIMITS["n_layers"]:
                raise ConfigError(f"model.moe_layers must be a list of layer ids, got {shown(layers, 80)}")
            values["moe_layers"] = tuple(layers)
        return cls(**values)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def expected_state_shapes(cfg: TinyMoEConfig) -> dict[str, tuple[int, ...]]:
    """{state_dict name: shape} of `TinyMoEPolicy(cfg)`, computed without building the module."""
    d, f, e, v = cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, d), "pos.weight": (cfg.max_seq_len, d)}
    moe_ids = set(cfg.moe_layer_ids)
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes.update(
            {
                p + "norm1.weight": (d,),
                p + "norm1.bias": (d,),
                p + "qkv.weight": (3 * d, d),
                p + "qkv.bias": (3 * d,),
                p + "proj.weight": (d, d),
                p + "proj.bias": (d,),
                p + "norm2.weight": (d,),
                p + "norm2.bias": (d,),
            }
        )
        if i in moe_ids:
            shapes.update({p + "ffn.router.weight": (e, d), p + "ffn.w_in": (e, d, f), p + "ffn.w_out": (e, f, d)})
        else:
            shapes.update(
                {
                    p + "ffn.up.weight": (f, d),
                    p + "ffn.up.bias": (f,),
                    p + "ffn.down.weight": (d, f),
                    p + "ffn.down.bias": (d,),
                }
            )
    shapes.update({"norm.weight": (d,), "norm.bias": (d,), "head.weight": (v, d)})
    return shapes


@dataclass
class RoutingControl:
    """How the MoE layers pick experts in one forward pass.

    `routes` [B, T, L_moe, K] replays recorded expert ids (-1: no recorded route, use current);
    `replay_tokens` [B, T] bool limits replay to some tokens (others route on current scores);
    `current_layers` lists global layer ids that always use current routing.
    """

    routes: torch.Tensor | None = None
    replay_tokens: torch.Tensor | None = None
    current_layers: frozenset[int] = field(default_factory=frozenset)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]; [B, 0, V] when the forward ended in the chunked head (`logprobs` given)
    aux_loss: torch.Tensor  # load-balancing loss summed over MoE layers
    z_loss: torch.Tensor  # router z-loss summed over MoE layers
    routes: torch.Tensor  # [B, T, L_moe, K] expert ids actually used
    logprobs: torch.Tensor | None = None  # [B, T] float32, from the chunked head (`models.chunked_head`)
    entropy: torch.Tensor | None = None  # [B, T] float32, when the head request asked for it


def head_output(
    head: ChunkedHead, hidden: torch.Tensor, tokens: torch.Tensor, request: HeadRequest | None, keep: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(logits, log-probs, entropies) at the end of a forward: the logits of the last `keep` positions (all when
    0) without a request; with one, no logits ([B, 0, V]) and the chunked head's log-probs and entropies."""
    if request is None:
        return head(hidden[:, -keep:] if keep else hidden), None, None
    logprobs, entropy = sequence_logprobs(head, hidden, tokens, request)
    return hidden.new_empty((hidden.shape[0], 0, head.out_features)), logprobs, entropy


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.n_experts = cfg.n_experts
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.d_ff))
        self.w_out = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_ff, cfg.d_model))
        nn.init.normal_(self.w_in, std=1.0 / math.sqrt(cfg.d_model))
        nn.init.normal_(self.w_out, std=1.0 / math.sqrt(cfg.d_ff))

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None, replay_tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, dim = x.shape
        scores = self.router(x)  # [B, T, E]
        probs = scores.float().softmax(dim=-1)
        chosen = probs.topk(self.top_k, dim=-1).indices  # [B, T, K]
        if replay is not None:
            use = replay >= 0
            if replay_tokens is not None:
                use = use & replay_tokens[..., None]
            chosen = torch.where(use, replay.clamp(min=0), chosen)
        gates = probs.gather(-1, chosen)
        gates = (gates / gates.sum(dim=-1, keepdim=True)).to(x.dtype)
        # Every expert on every token, then gather: tiny sizes, and a deterministic reduction order.
        hidden = F.gelu(torch.einsum("btd,edf->btef", x, self.w_in))
        expert_out = torch.einsum("btef,efd->bted", hidden, self.w_out)  # [B, T, E, D]
        picked = expert_out.gather(2, chosen[..., None].expand(batch, seq, self.top_k, dim))
        out = (picked * gates[..., None]).sum(dim=2)
        load = F.one_hot(chosen, self.n_experts).float().sum(dim=2).mean(dim=(0, 1)) / self.top_k
        aux = self.n_experts * (load * probs.mean(dim=(0, 1))).sum()
        z_loss = torch.logsumexp(scores.float(), dim=-1).pow(2).mean()
        return out, aux, z_loss, chosen


class DenseFeedForward(nn.Module):
    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyMoEConfig, moe: bool) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ffn: nn.Module = MoEFeedForward(cfg) if moe else DenseFeedForward(cfg)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        shape = (batch, seq, self.n_heads, dim // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, replay_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(output, aux loss, z-loss, chosen experts) of the block; the last three None for a dense block.

        One call per block, so a block can be its own FSDP unit (its parameters gathered around this call)."""
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        if isinstance(self.ffn, MoEFeedForward):
            out, aux, z_loss, chosen = self.ffn(h, replay, replay_tokens)
            return x + out, aux, z_loss, chosen
        return x + self.ffn(h), None, None, None


class TinyMoEPolicy(nn.Module):
    """Decoder-only policy: embeddings, pre-norm blocks (attention + MoE or dense FFN), LM head."""

    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        moe_ids = set(cfg.moe_layer_ids)
        self.layers: list[Block] = [Block(cfg, moe=i in moe_ids) for i in range(cfg.n_layers)]  # typed view
        self.blocks = nn.ModuleList(self.layers)  # registers them (parameter names blocks.<i>.*)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = ChunkedHead(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(
        self, tokens: torch.Tensor, routing: RoutingControl | None = None, head: HeadRequest | None = None
    ) -> ModelOutput:
        """Logits, router losses and routes; with a `head` request, the chunked head's log-probs (and entropies)
        instead of the logits."""
        routing = routing or RoutingControl()
        batch, seq = tokens.shape
        if seq > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {seq} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)[None]
        zero = x.new_zeros((), dtype=torch.float32)
        aux_total, z_total, routes = zero, zero, []
        moe_index = 0
        for layer_id, block in enumerate(self.layers):
            replay = None
            moe = isinstance(block.ffn, MoEFeedForward)
            if moe and routing.routes is not None and layer_id not in routing.current_layers:
                replay = routing.routes[:, :, moe_index, :].to(tokens.device)
            x, aux, z_loss, chosen = block(x, replay, routing.replay_tokens)
            if aux is not None and z_loss is not None and chosen is not None:
                aux_total, z_total = aux_total + aux, z_total + z_loss
                routes.append(chosen)
                moe_index += 1
        logits, logprobs, entropy = head_output(self.head, self.norm(x), tokens, head)
        stacked = torch.stack(routes, dim=2) if routes else tokens.new_zeros((batch, seq, 0, self.cfg.top_k))
        return ModelOutput(logits, aux_total, z_total, stacked, logprobs, entropy)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] log p(tokens[:, t] | tokens[:, :t]) in fp32; position 0 (no prefix) is 0."""
    logp = logits[:, :-1].float().log_softmax(dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return F.pad(logp, (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, T] entropy of the next-token distribution that predicted tokens[:, t]; position 0 is 0."""
    logp = logits[:, :-1].float().log_softmax(dim=-1)
    return F.pad(-(logp.exp() * logp).sum(dim=-1), (1, 0))
