"""Megatron's core attention as a transformers attention function, so route 1 computes Megatron's gradients on padded
batches too.

Transformers' eager attention *adds* its mask (0 or the dtype's minimum) to the scores; Megatron's unfused attention
*fills* the masked scores (`attention_mask_func`: `masked_fill_(mask, -10000.0)`, megatron-core 0.16.1,
megatron/core/transformer/utils.py). Both give the same probabilities, but a query whose keys are all masked (a
left-padding position) differs in its backward: filled scores pass no gradient to that row's queries and keys,
added ones do (softmax of equal values has a non-zero Jacobian). A loss that reaches padding positions (the router
z-loss and aux loss count every token) then moved the attention weights of route 1 by up to 30 % relative against
Megatron's on a left-padded batch (tests/megatron). With the scores filled, route 1 agrees within float32 ulps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAME = "megatron_eager"  # the transformers attention implementation route 1's model runs
MASKED_SCORE = -10000.0  # megatron.core.transformer.utils.attention_mask_func


def megatron_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' eager attention with Megatron's masking: masked scores filled with -10000, not added to."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    keys = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    values = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:  # transformers' eager mask: 0 where a key is seen, the dtype's minimum elsewhere
        scores = scores.masked_fill(attention_mask[..., : keys.shape[-2]] != 0, MASKED_SCORE)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


def use_megatron_attention(config: Any) -> None:
    """Register the attention function (and transformers' eager mask for it) and make `config` run it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, megatron_eager_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    config._attn_implementation = NAME
