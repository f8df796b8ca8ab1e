"""verl 0.9.1's per-rank mini-batch layouts, built from a batch the way verl builds them.

`padded_like_verl`: verl's padded batch (`prompts` left-padded, `responses` right-padded, `input_ids` their
concatenation, per-response fields `[batch, response_len]`). `jagged_like_verl`: the engine's unpadded layout of
a padded batch, as `verl.workers.utils.padding.left_right_2_no_padding` lays it out (jagged `input_ids` /
`position_ids` / `routed_experts` by the attention mask's cumulative lengths, `loss_mask` = `response_mask`).
"""

from __future__ import annotations

import torch


def padded_like_verl(batch: dict[str, torch.Tensor], routes: torch.Tensor, prompt: int) -> dict[str, torch.Tensor]:
    """Our full-width batch (prompts left-padded to `prompt` columns, with `attention_mask`) in verl's layout."""
    tokens, attention = batch["tokens"], batch["attention_mask"]
    response_mask = batch["loss_mask"][:, prompt:]
    advantages = batch["advantages"]
    if advantages.dim() == 1:  # verl broadcasts the outcome advantage over the response tokens
        advantages = advantages[:, None] * response_mask
    return {
        "prompts": tokens[:, :prompt],
        "responses": tokens[:, prompt:],
        "input_ids": tokens,
        "attention_mask": attention,
        "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "old_log_probs": batch["old_logprobs"][:, prompt:],
        "rollout_log_probs": batch["rollout_logprobs"][:, prompt:],
        "ref_log_prob": batch["ref_logprobs"][:, prompt:],
        "advantages": advantages,
        "routed_experts": routes,
        "batch_num_tokens": response_mask.sum(),
    }


def jagged_like_verl(padded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's unpadded layout of `padded`, as left_right_2_no_padding lays it out."""
    out = dict(padded)
    valid = padded["attention_mask"].bool()
    cu_seqlens = torch.nn.functional.pad(valid.sum(dim=1).cumsum(dim=0), (1, 0))
    for name in ("input_ids", "position_ids", "routed_experts"):
        out[name] = torch.nested.nested_tensor_from_jagged(padded[name][valid], offsets=cu_seqlens)
    out["loss_mask"] = padded["response_mask"]
    out["batch_num_tokens"] = padded["response_mask"].sum()
    return out
