"""The models the reference trainer can train: `tiny_moe`, or a transformers MoE architecture at a tiny size.

Torch-free, like `presets`: `capture --help` lists the names from here without loading the trainer.
Every transformers model is built from its own config class (nothing is downloaded): hidden 64, 8 experts,
top-2, vocab 1024, eager attention and experts, and deterministic algorithms pinned (see `models.policy`).
"""

from __future__ import annotations

import copy
from typing import Any

from axrl_spike_replay.errors import ConfigError

DEFAULT_CAPTURE_MODEL = "tiny_moe"
HF_RESPONSE_LEN = 32  # responses of a transformers capture (the tiny model's stay at 8 tokens)

_BASE: dict[str, Any] = {
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
# What each architecture needs beyond the shared base (dense layers where the architecture has them).
_EXTRA: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 32, "head_dim": 16, "norm_topk_prob": True},
    "qwen2_moe": {
        "num_experts": 8,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 3,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
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
HF_CAPTURE_MODELS = tuple(_EXTRA)
CAPTURE_MODELS = (DEFAULT_CAPTURE_MODEL, *HF_CAPTURE_MODELS)


def hf_model_section(architecture: str) -> dict[str, Any]:
    """The run config `model:` section (kind hf) of the tiny `architecture` the reference trainer trains."""
    if architecture not in _EXTRA:
        raise ConfigError(f"model {architecture!r} is not known (known: {', '.join(CAPTURE_MODELS)})")
    return {
        "kind": "hf",
        "architecture": architecture,
        "config": {"model_type": architecture, **copy.deepcopy(_BASE), **copy.deepcopy(_EXTRA[architecture])},
        "dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "deterministic_algorithms": True,
    }


def check_capture_model(name: str) -> None:
    """ConfigError listing the known models unless `name` is one."""
    if name not in CAPTURE_MODELS:
        raise ConfigError(f"model {name!r} is not known (known: {', '.join(CAPTURE_MODELS)})")
