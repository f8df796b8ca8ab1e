"""Megatron-core checkpoint keys onto transformers parameters: one declared table per architecture, and the layout
changes between them (fused QKV per query group; a dense MLP's fused gate/up rows; experts' fused gate/up is the
same in both).

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
- Qwen2-MoE: `linear_qkv.bias` [L, G*(Q/G+2)*D] is grouped as the weight's rows; the shared expert's
  `shared_experts.linear_fc1.weight` [L, 2S, H] is gate rows then up rows, `shared_experts.gate_weight` [L, 1, H]
  is `shared_expert_gate.weight`.
- DeepSeek-V3: its layers differ (dense first layers), so megatron-core saves each under its own key
  (`decoder.layers.<i>.…`, experts [E, ...]). MLA's projections keep transformers' layouts (q_a / q_b,
  kv_a_proj_with_mqa with its RoPE rows last, kv_b per head [nope | v]); both sides de-interleave the RoPE dims
  (megatron's `apply_rotary_pos_emb(multi_latent_attention=True)`, transformers' `rope_interleave`). A dense MLP's
  and the shared experts' `linear_fc1` [2F, H] are gate rows then up rows (`gate_proj`, `up_proj`). The router's
  `expert_bias` is transformers' `e_score_correction_bias`. The names are mbridge 0.15.1's (`DeepseekV3Bridge`,
  Transformer Engine's spec), which megatron-core's local spec is saved under (`models.mcore.megatron_deepseek`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import ConfigError

if TYPE_CHECKING:
    import torch

LAYER = "{layer}"


@dataclass(frozen=True)
class Rule:
    """One checkpoint key and the transformers parameter(s) it fills (`{layer}` in a stacked key's names)."""

    megatron: str
    hf: tuple[str, ...]
    split: str = "copy"  # "copy": as is; "qkv": the fused projection split per query group; "halves": gate | up rows
    optional: bool = False  # absent when the model ties it to another (output layer and tied embeddings)
    layers: str = "all"  # the decoder layers it exists in: "all", "dense" or "moe" (per-layer keys only)

    @property
    def stacked(self) -> bool:
        """A key stacked over the layers (axis 0), as opposed to a global key or one saved per layer."""
        return self.megatron.startswith("decoder.layers.") and not self.per_layer

    @property
    def per_layer(self) -> bool:
        """A key saved once per layer (`decoder.layers.{layer}.…`)."""
        return LAYER in self.megatron

    @property
    def layered(self) -> bool:
        """A rule of the decoder layers (stacked or per layer)."""
        return self.stacked or self.per_layer

    def applies(self, layer: int, moe_layers: frozenset[int]) -> bool:
        """Whether the rule has a key for decoder layer `layer`."""
        return self.layers == "all" or (self.layers == "moe") == (layer in moe_layers)

    def key(self, layer: int | None) -> str:
        """The checkpoint key for one layer (a per-layer rule) or as written."""
        return self.megatron.replace(LAYER, str(layer)) if self.per_layer and layer is not None else self.megatron


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


def _per_layer(name: str) -> str:
    return f"decoder.layers.{LAYER}.{name}"


def _mla(name: str, hf: str, **kw: str) -> Rule:
    return Rule(_per_layer(name), (_layer(hf),), **kw)  # type: ignore[arg-type]


_DEEPSEEK_V3 = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), optional=True),
    _mla("input_layernorm.weight", "input_layernorm.weight"),
    _mla("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    _mla("self_attention.linear_q_up_proj.layer_norm_weight", "self_attn.q_a_layernorm.weight"),
    _mla("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
    _mla("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    _mla("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attn.kv_a_layernorm.weight"),
    _mla("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    _mla("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    _mla("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight", layers="dense"),
    Rule(
        _per_layer("mlp.linear_fc1.weight"),
        (_layer("mlp.gate_proj.weight"), _layer("mlp.up_proj.weight")),
        split="halves",
        layers="dense",
    ),
    _mla("mlp.linear_fc2.weight", "mlp.down_proj.weight", layers="dense"),
    _mla("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", layers="moe"),
    _mla("mlp.router.weight", "mlp.gate.weight", layers="moe"),
    _mla("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", layers="moe"),
    _mla("mlp.experts.experts.linear_fc1.weight", "mlp.experts.gate_up_proj", layers="moe"),
    _mla("mlp.experts.experts.linear_fc2.weight", "mlp.experts.down_proj", layers="moe"),
    Rule(
        _per_layer("mlp.shared_experts.linear_fc1.weight"),
        (_layer("mlp.shared_experts.gate_proj.weight"), _layer("mlp.shared_experts.up_proj.weight")),
        split="halves",
        layers="moe",
    ),
    _mla("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight", layers="moe"),
)
# Without q_lora_rank the query is one projection (megatron-core's linear_q_proj, transformers' q_proj).
_DEEPSEEK_V3_FULL_Q = (
    *(r for r in _DEEPSEEK_V3 if "linear_q_down_proj" not in r.megatron and "linear_q_up_proj" not in r.megatron),
    _mla("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"),
)

# Qwen2-MoE: QKV biases (fused and split per query group as the weight), and a shared expert whose output
# a sigmoid gate [1, H] scales (megatron-core's `moe_shared_expert_gate`, transformers' `shared_expert_gate`).
_QKV_BIAS = Rule(
    "decoder.layers.self_attention.linear_qkv.bias",
    (_layer("self_attn.q_proj.bias"), _layer("self_attn.k_proj.bias"), _layer("self_attn.v_proj.bias")),
    split="qkv",
)
_QWEN2_MOE = (
    *_COMMON,
    Rule(
        "decoder.layers.mlp.shared_experts.linear_fc1.weight",
        (_layer("mlp.shared_expert.gate_proj.weight"), _layer("mlp.shared_expert.up_proj.weight")),
        split="halves",
    ),
    Rule("decoder.layers.mlp.shared_experts.linear_fc2.weight", (_layer("mlp.shared_expert.down_proj.weight"),)),
    Rule("decoder.layers.mlp.shared_experts.gate_weight", (_layer("mlp.shared_expert_gate.weight"),)),
)

MAPPINGS: dict[str, tuple[Rule, ...]] = {
    "qwen3_moe": _COMMON + _QK_NORMS,
    "qwen2_moe": _QWEN2_MOE,
    "mixtral": _COMMON,
    "deepseek_v3": _DEEPSEEK_V3,
}


def rules_for(architecture: str, config: dict[str, Any] | None = None) -> tuple[Rule, ...]:
    """The architecture's table (for DeepSeek-V3 without a query LoRA, its full query projection); ConfigError for
    one we do not map."""
    if architecture not in MAPPINGS:
        from axrl_spike_replay.models.mcore.megatron_config import unmapped_message

        raise ConfigError(unmapped_message(architecture))
    if architecture == "deepseek_v3" and config is not None and config.get("q_lora_rank") is None:
        return _DEEPSEEK_V3_FULL_Q
    if architecture == "qwen2_moe" and (config is None or config.get("qkv_bias", True)):
        return (*_QWEN2_MOE, _QKV_BIAS)
    return MAPPINGS[architecture]


def split_value(rule: Rule, value: torch.Tensor, heads: Heads) -> tuple[torch.Tensor, ...]:
    """One layer's checkpoint tensor as the rule's transformers tensors."""
    if rule.split == "qkv":
        return split_qkv(value, heads)
    if rule.split == "halves":
        return tuple(value.chunk(2, dim=0))
    return (value,)


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
