"""Where a parameter sits in an MoE policy, read off its name: its decoder layer and its family (embedding,
attention, norm, router, routed experts, shared expert, dense MLP, head). One reading for every architecture the
project builds (our tiny_moe's `blocks.N.ffn.w_in`, transformers' `model.layers.N.mlp.experts.gate_up_proj`,
Megatron's `decoder.layers.N.mlp.experts...`), so a pattern by layer or by family is named the same way everywhere.
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"(?:^|\.)(?:blocks|layers|h|layer)\.(\d+)\.")
FAMILIES = ("embedding", "attention", "norm", "router", "experts", "shared_expert", "mlp", "head", "other")
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("shared_expert", re.compile(r"shared_expert")),
    ("router", re.compile(r"(?:\.router\.|\.gate\.weight$|\.mlp\.gate\.|router)")),
    ("experts", re.compile(r"(?:\.experts\.|\.ffn\.w_(?:in|out)$|\.experts$)")),
    ("attention", re.compile(r"(?:attn|attention|\.qkv\.|\.proj\.|q_proj|k_proj|v_proj|o_proj|linear_qkv)")),
    ("norm", re.compile(r"(?:norm|\.ln_)")),
    ("mlp", re.compile(r"(?:\.mlp\.|\.ffn\.)")),
    ("embedding", re.compile(r"(?:embed|\.wte\.|^pos\.|\.wpe\.)")),
    ("head", re.compile(r"(?:^head\.|lm_head|output_layer)")),
)


def layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to (None: outside the layers, e.g. the embedding or the head)."""
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


def family_of(name: str) -> str:
    """The parameter's family, one of FAMILIES (`other` when no rule reads it)."""
    for family, rule in _RULES:
        if rule.search(name):
            return family
    return "other"
