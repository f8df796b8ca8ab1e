"""verl's per-rank mini-batch (jagged layout) laid back out as verl's padded batch, which the field aliases read.

verl 0.9.1's engine path trains on a TensorDict whose sequences have no padding
(`verl.workers.utils.padding.left_right_2_no_padding`): `input_ids`, `position_ids` and
`routed_experts` are jagged nested tensors (prompt + response tokens of each sample, one after the
other), while `response_mask` / `loss_mask`, `old_log_probs`, `advantages`, `rollout_log_probs`,
`ref_log_prob` stay padded `[batch, max_response_len]`. Here each sample goes back to verl's padded
layout: prompt left-padded to the longest prompt, response right-padded to `max_response_len`, so the
response's column j is prompt width + j and the padded per-token fields line up with the last columns
as `fields.canonicalize_batch` expects. Routes become `[batch, seq, layers, top_k]` with -1 padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError

if TYPE_CHECKING:
    import torch

# The step's global loss counts verl's engine sets on every rank's mini-batch (`forward_backward_batch`; the
# trainer's `global_batch_size`), which `agg_loss` normalises by; the verl hook saves them with the batch.
VERL_COUNT_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size")


def is_jagged(value: Any) -> bool:
    """Whether `value` is a jagged nested tensor (verl's unpadded sequences)."""
    import torch

    return isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged


def is_verl_jagged_batch(raw: Mapping[str, Any]) -> bool:
    """A verl engine mini-batch: jagged `input_ids` beside a padded `response_mask`."""
    return is_jagged(raw.get("input_ids")) and "response_mask" in raw


def _lengths(value: torch.Tensor) -> torch.Tensor:
    return value.offsets().diff()  # pyright: ignore[reportAttributeAccessIssue]


def _response_lengths(raw: Mapping[str, Any], batch: int, width: int, source: Path | str) -> torch.Tensor:
    """Each sample's response length: from jagged `responses`, the padded `attention_mask`, or the mask's extent."""
    import torch

    responses = raw.get("responses")
    if isinstance(responses, torch.Tensor) and is_jagged(responses):
        return _lengths(responses)
    attention = raw.get("attention_mask")
    if (
        isinstance(attention, torch.Tensor)
        and not attention.is_nested
        and attention.dim() == 2
        and attention.shape[0] == batch
        and attention.shape[1] >= width
    ):
        return attention[:, attention.shape[1] - width :].ne(0).sum(dim=1)
    mask = raw["response_mask"].ne(0)
    # Without either, the response ends at its last loss token (trailing masked tokens are not told apart).
    last = torch.where(mask, torch.arange(1, width + 1).expand(batch, width), torch.zeros_like(mask, dtype=torch.long))
    return last.max(dim=1).values


def _place(
    values: torch.Tensor, lengths: torch.Tensor, prompts: torch.Tensor, prompt_width: int, width: int, fill: int
) -> torch.Tensor:
    """Samples packed one after another in `values` laid out [batch, prompt_width + width, ...]."""
    import torch

    batch = lengths.numel()
    out = torch.full((batch, prompt_width + width, *values.shape[1:]), fill, dtype=values.dtype)
    start = 0
    for b in range(batch):
        n, p = int(lengths[b]), int(prompts[b])
        sample = values[start : start + n]
        out[b, prompt_width - p : prompt_width - p + n] = sample
        start += n
    return out


def verl_padded_batch(raw: Mapping[str, Any], source: Path | str) -> dict[str, Any]:
    """The jagged verl mini-batch `raw` in verl's padded layout (see the module doc); SnapshotError naming the field."""
    import torch

    ids = raw["input_ids"]
    mask = raw["response_mask"]
    if not isinstance(mask, torch.Tensor) or mask.is_nested or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) and not mask.is_nested else type(mask).__name__
        raise SnapshotError(f"{source}: 'response_mask' must be a padded [batch, response_len] tensor, got {shape}")
    lengths = _lengths(ids)
    batch, width = mask.shape
    if lengths.numel() != batch:
        raise SnapshotError(f"{source}: 'input_ids' holds {lengths.numel()} sequences but 'response_mask' {batch} rows")
    if ids.values().dim() != 1:
        raise SnapshotError(f"{source}: jagged 'input_ids' must hold one token id per position")
    responses = _response_lengths(raw, batch, width, source)
    prompts = lengths - responses
    if bool((prompts < 0).any()) or bool((responses > width).any()):
        raise SnapshotError(
            f"{source}: response lengths {shown(responses.tolist(), 80)} do not fit the sequences "
            f"{shown(lengths.tolist(), 80)} and response_mask width {width}"
        )
    prompt_width = int(prompts.max()) if batch else 0
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if not is_jagged(value):
            out[name] = value
            continue
        if not torch.equal(_lengths(value), lengths):
            raise SnapshotError(f"{source}: jagged field {shown(name, 80)} has other sequence lengths than 'input_ids'")
        if name == "position_ids":
            continue  # recomputed from the padded layout by whoever needs them
        fill = -1 if name == "routed_experts" else 0
        out[name] = _place(value.values(), lengths, prompts, prompt_width, width, fill)
    out["attention_mask"] = _place(
        torch.ones(int(lengths.sum()), dtype=torch.long), lengths, prompts, prompt_width, width, 0
    )
    return out


def verl_routes(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """`routed_experts` of a padded verl batch as [batch, seq, layers, top_k] int32, or None when absent."""
    import torch

    routes = batch.get("routed_experts")
    if not isinstance(routes, torch.Tensor) or routes.is_nested:
        return None
    if routes.dim() == 3:  # one MoE layer recorded without its layer axis
        routes = routes.unsqueeze(2)
    return routes.to(torch.int32) if routes.dim() == 4 else None
