"""Megatron-core's own `GPTModel` for a `kind: megatron` spec, in the current parallel state (needs megatron-core).

The TransformerConfig is derived from the HF config the way mbridge derives it (`LLMBridge._build_base_config`
and each architecture's `_build_config`, mbridge 0.15.1; tests/megatron checks the two agree field by field),
with what running on CPU requires: the local layer spec (no Transformer Engine), `use_cpu_initialization`,
the `allgather` token dispatcher, SequentialMLP experts (no grouped GEMM) and sequence parallel with TP>1.
None of these changes the checkpoint's keys or the function the model computes.

Call everything here inside `megatron_on_cpu()` on a CPU-only torch, with megatron's `parallel_state` initialised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig


@dataclass(frozen=True)
class MegatronParallel:
    """The model-parallel sizes a GPTModel is built for (data parallel is whatever remains of the world)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1


def init_parallel(parallel: MegatronParallel) -> None:
    """Megatron's parallel_state over the current process group (reset if set before); data parallel is the rest."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
    )


def _rope_theta(config: dict[str, Any]) -> float:
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return float(theta if theta is not None else config.get("rope_theta", 10000.0))


def hf_config_values(spec: MegatronModelConfig) -> dict[str, Any]:
    """The HF config with transformers' defaults filled in (what the architecture's config class holds)."""
    from axrl_spike_replay.models.hf_config import hf_config_object

    return hf_config_object(spec.hf).to_dict()


def transformer_config_kwargs(spec: MegatronModelConfig, parallel: MegatronParallel) -> dict[str, Any]:
    """TransformerConfig arguments for the spec: the model's own (as mbridge maps them) and the CPU-run ones."""
    c = hf_config_values(spec)
    heads = int(c["num_attention_heads"])
    experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)
    expert_ffn = int(c.get("moe_intermediate_size") or c["intermediate_size"])
    dtype = spec.torch_dtype
    kwargs: dict[str, Any] = {
        # the model (mbridge 0.15.1: LLMBridge._CONFIG_MAPPING, _build_base_config, Qwen3MoEBridge / MixtralBridge)
        "num_layers": int(c["num_hidden_layers"]),
        "hidden_size": int(c["hidden_size"]),
        "num_attention_heads": heads,
        "num_query_groups": int(c.get("num_key_value_heads") or heads),
        "ffn_hidden_size": int(c["intermediate_size"]),
        "kv_channels": int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        "layernorm_epsilon": float(c["rms_norm_eps"]),
        "attention_dropout": float(c.get("attention_dropout") or 0.0),
        "hidden_dropout": 0.0,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": spec.architecture == "qwen3_moe",
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": expert_ffn,
        "moe_router_topk": int(c["num_experts_per_tok"]),
        "moe_router_score_function": "softmax",
        # softmax over the top-k logits is the renormalised top-k of the softmax (norm_topk_prob; Mixtral always)
        "moe_router_pre_softmax": not (spec.architecture == "mixtral" or bool(c.get("norm_topk_prob"))),
        "moe_router_load_balancing_type": "none",  # the aux and z losses are the replayed loss's (loss: section)
        "moe_aux_loss_coeff": 0.0,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype is torch.bfloat16,
        "fp16": dtype is torch.float16,
        # parallelism
        "tensor_model_parallel_size": parallel.tp,
        "pipeline_model_parallel_size": parallel.pp,
        "expert_model_parallel_size": parallel.ep,
        "expert_tensor_parallel_size": parallel.etp,
        "sequence_parallel": False,  # the torch norm fallback refuses it (TP>1 forwards run in eval mode)
        # what a CPU run needs; none of it changes the checkpoint's keys or the function computed
        "use_cpu_initialization": True,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_enable_routing_replay": True,
        "persist_layer_norm": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        "apply_rope_fusion": False,
    }
    if spec.architecture == "qwen2_moe":
        # a shared expert of its own width whose output a sigmoid gate scales (mbridge's Qwen2MoEBridge sets the
        # width and the QKV bias but not the gate, which transformers' Qwen2-MoE always has)
        kwargs.update(
            add_qkv_bias=bool(c.get("qkv_bias", True)),
            moe_shared_expert_intermediate_size=int(c["shared_expert_intermediate_size"]),
            moe_shared_expert_gate=True,
        )
    if spec.architecture == "deepseek_v3":
        from axrl_spike_replay.models.mcore.megatron_deepseek import deepseek_config_kwargs

        kwargs.update(deepseek_config_kwargs(c), rotary_base=_rope_theta(c))
    return kwargs


def build_gpt_model(spec: MegatronModelConfig, parallel: MegatronParallel | None = None, *, seed: int = 0) -> Any:
    """Megatron-core's GPTModel for the spec on this rank's pipeline stage (random weights, seeded)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from axrl_spike_replay.models.mcore.megatron_cpu import initialize_cpu_rng
    from axrl_spike_replay.models.mcore.megatron_deepseek import deepseek_block_spec

    parallel = parallel or MegatronParallel()
    kwargs = transformer_config_kwargs(spec, parallel)
    mla = bool(kwargs.get("multi_latent_attention"))
    try:
        config = (MLATransformerConfig if mla else TransformerConfig)(**kwargs)
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(f"model: megatron-core's TransformerConfig refuses the spec ({exc})") from None
    layer_spec = (
        deepseek_block_spec(config)
        if mla
        else get_gpt_layer_local_spec(
            num_experts=kwargs["num_moe_experts"],
            moe_grouped_gemm=False,
            qk_layernorm=kwargs["qk_layernorm"],
            normalization="RMSNorm",
        )
    )
    initialize_cpu_rng(seed)
    c = hf_config_values(spec)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=int(c["vocab_size"]),
        max_sequence_length=int(c.get("max_position_embeddings") or 4096),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(c.get("tie_word_embeddings")),
        position_embedding_type="rope",
        rotary_base=_rope_theta(c),  # type: ignore[arg-type] - megatron annotates an int, uses it as a float
    )


def causal_padding_mask(attention_mask: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor:
    """Megatron's attention mask [B, 1, S, S] (True = masked): causal, and padding keys masked as transformers
    masks them. A padding query row sees nothing, as in transformers' eager attention."""
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    if attention_mask is None:
        return causal.expand(batch, 1, seq, seq)
    keys = attention_mask.to(torch.bool).cpu()[:, None, None, :]
    return causal | ~keys


def position_ids(attention_mask: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor:
    """Positions counting real tokens only (left padding), as RL trainers and `HFPolicy` compute them."""
    if attention_mask is None:
        return torch.arange(seq)[None].expand(batch, seq)
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
