"""Helpers of the Megatron tests: the skip reason, functions run inside megatron-core rank processes (spawned:
importable module-level functions), and mbridge's mapping of a live Megatron model's names (the peer check)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from axrl_spike_replay.models.megatron_cpu import megatron_unavailable_reason

REASON = megatron_unavailable_reason()


def load_gpt(section: dict[str, Any], checkpoint: str) -> Any:
    """Megatron-core's GPTModel for the section (TP=PP=EP=1), its weights loaded by `dist_checkpointing.load`."""
    from megatron.core import dist_checkpointing

    from axrl_spike_replay.models.megatron_config import MegatronModelConfig
    from axrl_spike_replay.models.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel

    init_parallel(MegatronParallel())
    model = build_gpt_model(MegatronModelConfig.from_dict(section))
    state = dist_checkpointing.load(model.sharded_state_dict(), checkpoint)
    model.load_state_dict(state, strict=False)
    return model


def simple_loss(out: Any, batch: dict[str, torch.Tensor], router: float = 0.0) -> torch.Tensor:
    """A loss with a gradient through every log-prob the mask keeps, plus `router` x (aux + z loss)."""
    mask = batch["loss_mask"]
    weights = torch.linspace(-1.0, 1.0, mask.shape[-1])
    return -(out.logprobs * mask * weights).sum() / mask.sum() + router * (out.aux_loss + out.z_loss)


def forward_backward(
    rank: int, world: int, payload: tuple[dict[str, Any], str, dict[str, torch.Tensor], str, Any, float]
) -> None:
    """Megatron's own forward and backward of `batch` (routes forced when given): log-probs, routes, grads saved."""
    from axrl_spike_replay.models.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.megatron_policy import force_routes, install_trace, megatron_logprobs
    from axrl_spike_replay.snapshot.megatron_routes import to_router_replay

    section, checkpoint, batch, out, routes, router = payload
    torch.manual_seed(0)
    with megatron_on_cpu():
        model = load_gpt(section, checkpoint)
        trace = install_trace(model)
        layers = sorted(trace_layers(model))
        force_routes(model, None if routes is None else dict(zip(layers, to_router_replay(routes), strict=True)))
        result = megatron_logprobs(model, trace, batch)
        simple_loss(result, batch, router).backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    torch.save({"logprobs": result.logprobs.detach(), "routes": result.routes, "grads": grads}, Path(out))


def trace_layers(model: Any) -> list[int]:
    from axrl_spike_replay.models.megatron_policy import routers

    return list(routers(model))


# The local spec's parameter names as Transformer Engine's MoE spec (and mbridge) name them: the input norm fused
# into linear_qkv (the pre-MLP norm of an MoE layer stays a module), experts as grouped-GEMM names
# (`linear_fc1.weight<e>`).
_TE_NAMES = (
    (re.compile(r"\.input_layernorm\.weight$"), ".self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"), r".mlp.experts.\2.weight\1"),
)


def mbridge_to_hf(section: dict[str, Any], tensors: dict[str, torch.Tensor], hf_model: Any) -> dict[str, torch.Tensor]:
    """A live Megatron model's tensors (local spec names, TP=PP=EP=1) under transformers' names and layout, by
    mbridge's mapping and QKV / gate-up split (per-expert names merged by transformers' own conversion)."""
    from mbridge.core.parallel_states import ParallelStates
    from mbridge.models.qwen3moe import Qwen3MoEBridge

    from axrl_spike_replay.models.hf_config import hf_config_object
    from axrl_spike_replay.models.hf_weights import to_model_layout
    from axrl_spike_replay.models.megatron_config import MegatronModelConfig

    spec = MegatronModelConfig.from_dict(section)
    assert spec.architecture == "qwen3_moe", (
        "the peer check maps Qwen3-MoE (mbridge's Mixtral keeps transformers 4 names)"
    )
    bridge = Qwen3MoEBridge(hf_config_object(spec.hf), dtype=torch.float32, parallel_states=ParallelStates())
    per_expert: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for pattern, replacement in _TE_NAMES:
            name = pattern.sub(replacement, name)
        names, values = bridge._weight_to_hf_format(name, tensor)
        per_expert.update(zip(names, values, strict=True))
    return to_model_layout(hf_model, per_expert)


def build_mla_locally(rank: int, world: int, payload: None) -> None:
    """Megatron-core's GPTModel with Multi-Latent Attention (DeepSeek-V3's) on the local spec: no Transformer
    Engine, CPU. Raises what megatron-core raises."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import MLATransformerConfig

    from axrl_spike_replay.models.megatron_cpu import initialize_cpu_rng, megatron_on_cpu
    from axrl_spike_replay.models.megatron_gpt import MegatronParallel, init_parallel

    with megatron_on_cpu():
        init_parallel(MegatronParallel())
        config = MLATransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, q_lora_rank=32,
            kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, num_moe_experts=8,
            moe_ffn_hidden_size=32, moe_router_topk=2, moe_layer_freq=[0, 1], normalization="RMSNorm",
            qk_layernorm=True, use_cpu_initialization=True, moe_token_dispatcher_type="allgather", rope_type="rope",
            persist_layer_norm=False, add_bias_linear=False, gated_linear_unit=True,
        )  # fmt: skip
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        initialize_cpu_rng(0)
        GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=64)
