"""Config-only snapshots: the metadata, the run config and each rank's batch, but no weights, for planning the
replay of a model far larger than this machine (`plan`). The batches hold zeros of the given shape.

`QWEN3_30B_A3B`, `QWEN3_CODER_480B_A35B` and `DEEPSEEK_V3` are the published `config.json` values (the sizes that
decide memory) of Qwen/Qwen3-30B-A3B, Qwen/Qwen3-Coder-480B-A35B-Instruct and deepseek-ai/DeepSeek-V3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from axrl_spike_replay.snapshot.layout import AXRL_METADATA, RUN_CONFIG, batch_file
from axrl_spike_replay.snapshot.metadata import AxrlMetadata, DetectorSpec, ParallelLayout

QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}
QWEN3_CODER_480B_A35B: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 6144,
    "intermediate_size": 8192,
    "num_hidden_layers": 62,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_experts": 160,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2560,
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
    "rope_theta": 10000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}


def write_config_only_snapshot(
    directory: Path,
    architecture: str,
    config: dict[str, Any],
    *,
    world_size: int,
    batch: int,
    seq: int,
    dtype: str = "bfloat16",
    attention: str = "eager",
    micro_batches: int = 1,
) -> Path:
    """A snapshot dir `directory` (created) for an HF `architecture` with `config`, saved at `world_size`, each
    rank's batch [batch, seq] (in `micro_batches` micro-batches of [batch / micro_batches, seq], as the trainer ran
    them), its attention kernel `attention`; no weights."""
    import torch

    directory.mkdir(parents=True, exist_ok=False)
    meta = AxrlMetadata(
        job_name=f"plan-{architecture}",
        role="actor",
        iteration=1,
        grad_norm=10.0,
        median_norm=1.0,
        spike_ratio=10.0,
        detector=DetectorSpec(),
        parallel=ParallelLayout(world_size=world_size, dp=world_size),
    )
    (directory / AXRL_METADATA).write_text(json.dumps(meta.to_json()))
    run_config = {
        "model": {
            "kind": "hf",
            "architecture": architecture,
            "config": config,
            "dtype": dtype,
            "attn_implementation": attention,
        },
        "loss": {},
        "routing": {},
        "parallel": {"world_size": world_size, "dp": world_size},
    }
    (directory / RUN_CONFIG).write_text(yaml.safe_dump(run_config, sort_keys=False))
    if micro_batches < 1 or batch % micro_batches:
        raise ValueError(f"{micro_batches} micro-batches do not split a batch of {batch}")
    part = batch // micro_batches
    mask = torch.ones(part, seq)
    tokens = torch.zeros(part, seq, dtype=torch.long)
    parts = [{"tokens": tokens, "loss_mask": mask} for _ in range(micro_batches)]
    for rank in range(world_size):
        torch.save(parts[0] if micro_batches == 1 else {"micro_batches": parts}, directory / batch_file(rank))
    return directory
