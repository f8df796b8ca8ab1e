"""The transformers MoE architectures the torch engine builds (`model.kind: hf`), each declared once.

An `Architecture` says everything the tool needs to know of one: its tiny config (what the tests and the
reference trainer's captures build: the shared TINY_BASE plus its own keys), the rule that turns its router's
current logits and the forced expert ids into gate weights (routing replay), the config keys that size it
beyond the shared ones with their bounds (checked before anything is built), and where its routing hook goes
(the decoder layer's `mlp.<router>`). Adding an architecture is one entry in ARCHITECTURES, as adding a
mitigation is one entry in `experiment.mitigation.mitigations.MITIGATIONS`; tests/models/test_architecture_registry.py
walks every entry against transformers' own build.

Torch-free at import (`capture --help` lists the names from here); the weight rules import torch when called.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

if TYPE_CHECKING:
    import torch

WeightRule = Callable[[Any, "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
MAX_EXPERTS = 4096
MAX_EXPERT_WIDTH = 1 << 18

# The tiny models share this much: hidden 64, 4 heads, top-2, vocab 1024, 2 decoder layers (some add a dense one).
TINY_BASE: dict[str, Any] = {
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


@dataclass(frozen=True)
class Architecture:
    """One transformers MoE architecture as the torch engine builds and replays it."""

    name: str  # transformers' model_type
    tiny: Mapping[str, Any] = field(hash=False)  # the tiny model's config beyond TINY_BASE (8 experts, top-2)
    weight_rule: WeightRule = field(hash=False)  # gate weights [N, K] from router logits [N, E], chosen ids [N, K]
    size_limits: Mapping[str, int] = field(hash=False)  # its own sizing keys (experts, expert widths): bounds
    router: str = "gate"  # the attribute of a decoder layer's `mlp` that routes (where the routing hook goes)

    def tiny_config(self) -> dict[str, Any]:
        """The tiny model's HF config, `model_type` included (a fresh copy)."""
        return {"model_type": self.name, **copy.deepcopy(TINY_BASE), **copy.deepcopy(dict(self.tiny))}


# Gate weights from the current router logits [N, E] and chosen expert ids [N, K]: each architecture's own rule,
# written as its router computes them (same ops, same dtypes) so its own routes give bit-identical weights.
def softmax_topk(router: Any, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE, Qwen2-MoE, OLMoE: softmax over all experts in float, the chosen ones, renormalised if asked."""
    import torch

    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    weights = probs.gather(-1, chosen)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def mixtral_topk(router: Any, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax over all experts, the chosen ones always renormalised."""
    import torch

    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, chosen)
    return weights / weights.sum(dim=-1, keepdim=True)


def sigmoid_scaled(router: Any, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores; the correction bias and group limit only choose experts, never weight them."""
    weights = logits.sigmoid().gather(1, chosen)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def softmax_of_chosen(router: Any, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the chosen experts' logits only."""
    import torch

    top = logits.gather(-1, chosen)
    return torch.nn.functional.softmax(top, dim=1, dtype=top.dtype)


def _experts(key: str, **widths: int) -> dict[str, int]:
    """The bounds of an architecture's experts-count key and its expert widths."""
    return {key: MAX_EXPERTS, **widths}


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            "qwen3_moe",
            tiny={"num_experts": 8, "moe_intermediate_size": 32, "head_dim": 16, "norm_topk_prob": True},
            weight_rule=softmax_topk,
            size_limits=_experts("num_experts", moe_intermediate_size=MAX_EXPERT_WIDTH),
        ),
        Architecture(
            "qwen2_moe",
            tiny={
                "num_experts": 8,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "num_hidden_layers": 3,
                "mlp_only_layers": [1],
                "norm_topk_prob": True,
            },
            weight_rule=softmax_topk,
            size_limits=_experts(
                "num_experts",
                moe_intermediate_size=MAX_EXPERT_WIDTH,
                shared_expert_intermediate_size=MAX_EXPERT_WIDTH,
            ),
        ),
        Architecture(
            "olmoe",
            tiny={"num_experts": 8, "intermediate_size": 32},
            weight_rule=softmax_topk,
            size_limits=_experts("num_experts"),
        ),
        Architecture(
            "mixtral",
            tiny={"num_local_experts": 8, "intermediate_size": 32},
            weight_rule=mixtral_topk,
            size_limits=_experts("num_local_experts"),
        ),
        Architecture(
            "deepseek_v3",
            tiny={
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
            weight_rule=sigmoid_scaled,
            size_limits=_experts("n_routed_experts", moe_intermediate_size=MAX_EXPERT_WIDTH),
        ),
        Architecture(
            "gpt_oss",
            tiny={"num_local_experts": 8, "intermediate_size": 32, "head_dim": 16, "sliding_window": 8},
            weight_rule=softmax_of_chosen,
            size_limits=_experts("num_local_experts"),
            router="router",
        ),
    )
}


def architecture(name: str) -> Architecture:
    """The declared architecture `name`; ConfigError listing the declared ones otherwise."""
    found = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"architecture {shown(name, 60)} is not declared (declared: {', '.join(ARCHITECTURES)})")
    return found
