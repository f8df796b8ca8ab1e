"""Megatron-core checkpoint keys onto transformers parameters: one declared table per architecture, and the two
layout changes between them (fused QKV per query group, and nothing else: experts' fused gate/up is the same).

The table is written for the checkpoint's global keys (layers stacked on axis 0, experts on axis 1), which no
library maps: mbridge 0.15.1 maps the per-layer grouped-GEMM parameter names of a live model, and
Megatron-Bridge needs Transformer Engine to import. tests/megatron checks this table against mbridge's own
mapping and QKV split on the same checkpoint, tensor for tensor. Megatron names the local spec's norms as
Transformer Engine fuses them (`linear_qkv.layer_norm_weight` is the input norm, `mlp.linear_fc1.layer_norm_weight`
the pre-MLP norm) in both specs, so one table serves checkpoints of either.

Layouts (megatron-core 0.16.1):
- `linear_qkv.weight` [L, G*(Q/G+2)*D, H]: per query group g, its Q/G query heads, then its key head, then its
  value head (D rows each); transformers keeps q_proj [Q*D, H], k_proj [G*D, H], v_proj [G*D, H].
- experts' `linear_fc1.weight` [L, E, 2F, H]: gate rows then up rows, as transformers' `gate_up_proj` [E, 2F, H];
  `linear_fc2.weight` [L, E, H, F] is `down_proj` [E, H, F]; the router [L, E, H] is `mlp.gate.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from axrl_spike_replay.errors import ConfigError

if TYPE_CHECKING:
    import torch

LAYER = "{layer}"


@dataclass(frozen=True)
class Rule:
    """One checkpoint key and the transformers parameter(s) it fills (`{layer}` in a stacked key's names)."""

    megatron: str
    hf: tuple[str, ...]
    split: str = "copy"  # "copy": the tensor as is; "qkv": the fused projection split per query group
    optional: bool = False  # absent when the model ties it to another (output layer and tied embeddings)

    @property
    def stacked(self) -> bool:
        return self.megatron.startswith("decoder.layers.")


def _layer(name: str) -> str:
    return f"model.layers.{LAYER}.{name}"


_COMMON = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), optional=True),
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (_layer("input_layernorm.weight"),)),
    Rule(
        "decoder.layers.self_attention.linear_qkv.weight",
        (_layer("self_attn.q_proj.weight"), _layer("self_attn.k_proj.weight"), _layer("self_attn.v_proj.weight")),
        split="qkv",
    ),
    Rule("decoder.layers.self_attention.linear_proj.weight", (_layer("self_attn.o_proj.weight"),)),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", (_layer("post_attention_layernorm.weight"),)),
    Rule("decoder.layers.mlp.router.weight", (_layer("mlp.gate.weight"),)),
    Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight", (_layer("mlp.experts.gate_up_proj"),)),
    Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight", (_layer("mlp.experts.down_proj"),)),
)
_QK_NORMS = (
    Rule("decoder.layers.self_attention.q_layernorm.weight", (_layer("self_attn.q_norm.weight"),)),
    Rule("decoder.layers.self_attention.k_layernorm.weight", (_layer("self_attn.k_norm.weight"),)),
)

MAPPINGS: dict[str, tuple[Rule, ...]] = {
    "qwen3_moe": _COMMON + _QK_NORMS,
    "mixtral": _COMMON,
}


def rules_for(architecture: str) -> tuple[Rule, ...]:
    """The architecture's table; ConfigError for one we do not map."""
    if architecture not in MAPPINGS:
        from axrl_spike_replay.models.megatron_config import _unmapped

        raise ConfigError(_unmapped(architecture))
    return MAPPINGS[architecture]


@dataclass(frozen=True)
class Heads:
    """Attention head counts the QKV split needs: query heads, query groups (KV heads), head size."""

    query: int
    groups: int
    size: int

    def rows(self) -> tuple[int, int, int]:
        """(q, k, v) rows of one query group in the fused projection."""
        return self.query // self.groups * self.size, self.size, self.size


def split_qkv(fused: torch.Tensor, heads: Heads) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's fused `linear_qkv` [G*(Q/G+2)*D, ...] as transformers' (q_proj, k_proj, v_proj)."""
    q_rows, k_rows, v_rows = heads.rows()
    grouped = fused.reshape(heads.groups, q_rows + k_rows + v_rows, *fused.shape[1:])
    q, k, v = grouped.split((q_rows, k_rows, v_rows), dim=1)
    rest = fused.shape[1:]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: Heads) -> torch.Tensor:
    """The inverse of `split_qkv` (transformers' projections as Megatron's fused one)."""
    import torch

    rest = q.shape[1:]
    parts = (t.reshape(heads.groups, -1, *rest) for t in (q, k, v))
    return torch.cat(tuple(parts), dim=1).reshape(-1, *rest)


def hf_names(rule: Rule, layer: int | None) -> tuple[str, ...]:
    """The rule's transformers names for one layer (a stacked key) or as they are (a global one)."""
    return tuple(name.replace(LAYER, str(layer)) for name in rule.hf) if layer is not None else rule.hf
