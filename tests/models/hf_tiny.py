"""Tiny configs of the six supported transformers MoE architectures (hidden 64, 8 experts, top-2, vocab 1024)."""

from __future__ import annotations

from typing import Any

BASE: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
EXTRA: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 32, "head_dim": 16, "norm_topk_prob": True},
    "qwen2_moe": {
        "num_experts": 8,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 3,
        "mlp_only_layers": [1],
    },
    "olmoe": {"num_experts": 8, "intermediate_size": 32},
    "mixtral": {"num_local_experts": 8, "intermediate_size": 32},
    "deepseek_v3": {
        "n_routed_experts": 8,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "rope_scaling": None,
    },
    "gpt_oss": {"num_local_experts": 8, "intermediate_size": 32, "head_dim": 16, "sliding_window": 8},
}
ARCHITECTURES = tuple(EXTRA)


def tiny_config(architecture: str) -> dict[str, Any]:
    """The HF config dict of a tiny `architecture` model."""
    return {**BASE, **EXTRA[architecture]}


def model_section(architecture: str, **overrides: Any) -> dict[str, Any]:
    """A run config `model:` section (kind hf) for the tiny architecture."""
    return {
        "kind": "hf",
        "architecture": architecture,
        "config": tiny_config(architecture),
        "dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        **overrides,
    }
