"""Megatron-core's DeepSeek-V3: the TransformerConfig a transformers DeepSeek-V3 config gives, and its layer specs on
the local (no Transformer Engine) backend (needs megatron-core; the CPU patches are `models.mcore.megatron_cpu`'s).

The config follows mbridge 0.15.1 (`DeepseekV3Bridge._build_config`): Multi-Latent Attention with q/kv LoRA ranks
and a RoPE head part, the first `first_k_dense_replace` layers dense (`moe_layer_freq`), shared experts as one
MLP of `n_shared_experts` x the expert width, and a sigmoid router with an expert bias (`e_score_correction_bias`),
group-limited top-k (`n_group`, `topk_group`) and `routed_scaling_factor`. Multi-token prediction layers are not
built: transformers' model has none, so a checkpoint holding them is refused by its `mtp.` keys.

The layer specs are megatron-core's own (`get_gpt_decoder_block_spec`) with two changes: the core attention takes
MLA's key and value widths (`mla_core_attention`), and the local spec's norms are saved under the names Transformer
Engine's spec gives them (`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`, and
`mlp.linear_fc1.layer_norm_weight` for a dense layer), as megatron-core's own local GPT spec does for its norms
(`sharded_state_dict_keys_map`). So a checkpoint written here has the keys a GPU trainer's has.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Local-spec module names as Transformer Engine's MLA spec saves them (megatron-core 0.16.1,
# get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, qk_layernorm=True)).
TE_NORM_NAMES = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
TE_DENSE_NORM_NAMES = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}  # a dense layer's norm fuses into fc1


def dense_layers(config: dict[str, Any]) -> int:
    """How many leading decoder layers are dense (`first_k_dense_replace`, capped at the layer count)."""
    return min(int(config.get("first_k_dense_replace") or 0), int(config["num_hidden_layers"]))


def deepseek_config_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The DeepSeek-V3-specific TransformerConfig (MLATransformerConfig) arguments, as mbridge maps them."""
    layers = int(config["num_hidden_layers"])
    dense = dense_layers(config)
    groups = int(config.get("n_group") or 1)
    return {
        "num_moe_experts": int(config["n_routed_experts"]),
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
        "moe_shared_expert_intermediate_size": int(config["moe_intermediate_size"])
        * int(config.get("n_shared_experts") or 0)
        or None,
        "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": int(config["topk_group"]) if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
        "qk_layernorm": True,  # MLA's q/kv LoRA norms
        "multi_latent_attention": True,
        "q_lora_rank": config.get("q_lora_rank"),
        "kv_lora_rank": int(config["kv_lora_rank"]),
        "qk_head_dim": int(config["qk_nope_head_dim"]),
        "qk_pos_emb_head_dim": int(config["qk_rope_head_dim"]),
        "v_head_dim": int(config["v_head_dim"]),
        **rope_kwargs(config),
    }


def rope_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """MLA's RoPE: plain, or yarn with the config's factor, correction range and mscales (mbridge's keys)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind != "yarn":
        return {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(
            rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
        ),
        "beta_fast": float(rope.get("beta_fast") or 32.0),
        "beta_slow": float(rope.get("beta_slow") or 1.0),
        "mscale": float(rope.get("mscale") or 1.0),
        "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
    }


def deepseek_block_spec(config: Any) -> Any:
    """megatron-core's decoder block spec for the MLA config on the local backend, with the core attention taking
    MLA's widths and the norms saved under Transformer Engine's names."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from axrl_spike_replay.models.mcore.megatron_cpu import mla_core_attention

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    specs = []
    for layer in block.layer_specs or ():
        layer: Any  # a ModuleSpec of TransformerLayer; megatron annotates its submodules as `object`
        attention = layer.submodules.self_attention
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, core_attention=mla_core_attention())
        )
        dense = layer.submodules.mlp.module is not MoELayer
        names = {**TE_NORM_NAMES, **(TE_DENSE_NORM_NAMES if dense else {})}
        submodules = dataclasses.replace(layer.submodules, self_attention=attention, sharded_state_dict_keys_map=names)
        specs.append(dataclasses.replace(layer, submodules=submodules))
    return dataclasses.replace(block, layer_specs=specs)
