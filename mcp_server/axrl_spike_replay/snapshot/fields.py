"""Batch field names: canonical names and the aliases other RL stacks (verl, slime, OpenRLHF, NeMo-RL) use."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import SnapshotError

if TYPE_CHECKING:
    import torch

# canonical name -> accepted names, canonical first
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "tokens": ("tokens", "input_ids", "sequences"),
    "loss_mask": ("loss_mask", "loss_masks", "response_mask", "action_mask", "token_mask"),
    "advantages": ("advantages",),
    "old_logprobs": ("old_logprobs", "old_log_probs", "log_probs", "action_log_probs", "prev_logprobs"),
    "ref_logprobs": (
        "ref_logprobs",
        "ref_log_prob",
        "ref_log_probs",
        "base_action_log_probs",
        "reference_policy_logprobs",
    ),
    "rollout_logprobs": ("rollout_logprobs", "rollout_log_probs", "generation_logprobs"),
    "rewards": ("rewards", "token_level_rewards", "scores"),
    "turn_index": ("turn_index",),
}
REQUIRED_FIELDS = ("tokens", "loss_mask")
# verl's response width R when the per-token fields were [B, R] beside [B, P + R] tokens: the horizon of its
# `seq-mean-token-sum-norm` (a 0-dim long tensor; absent for full-width batches)
RESPONSE_WIDTH = "response_width"
PER_TOKEN_FIELDS = ("loss_mask", "old_logprobs", "ref_logprobs", "rollout_logprobs", "turn_index")
# verl's rollout-correction IS weights, `[B, R]` per response token, as its driver computed them before the update
# (decoupled mode); kept under verl's name (no other stack has them) and right-aligned like the per-token fields.
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
# a flattened `micro_batches` file's split: each part's sequences and token width (`training.micro_batches`)
MICRO_BATCH_ROWS = "micro_batch_rows"
MICRO_BATCH_WIDTHS = "micro_batch_widths"


def find_field(raw: Mapping[str, Any], canonical: str) -> tuple[str, Any] | None:
    """(name found, value) for the first accepted name of `canonical` present in `raw`."""
    for name in FIELD_ALIASES[canonical]:
        if name in raw:
            return name, raw[name]
    return None


def canonicalize_batch(raw: Mapping[str, Any], source: Path | str) -> dict[str, torch.Tensor]:
    """Map a rank batch onto canonical names; right-align narrower per-token tensors to `tokens`.

    verl's layout maps onto ours here, for every reader: response-width fields `[B, R]` beside `[B, P + R]`
    tokens end up at the last R columns (response token j at column P + j, where the policy's log-prob of
    it is), `RESPONSE_WIDTH` keeps R, and a batch with an `attention_mask` (left-padded prompts) gets
    `position_ids` counted from it when it has none (a jagged batch's are rebuilt from the padded layout).
    `{"micro_batches": [...]}` is flattened into one batch (sequences padded on the right), which keeps the split:
    each part's sequence count under `micro_batch_rows` and its token width under `micro_batch_widths` (1-D long
    tensors; `training.micro_batches` replays the rank part by part from them).
    Unknown keys are kept under their own names.
    """
    import torch

    if not isinstance(raw, Mapping):
        raise SnapshotError(f"{source}: a rank batch must be a dict of tensors, got {type(raw).__name__}")
    from axrl_spike_replay.snapshot.trainer_formats.verl_batch import is_verl_jagged_batch, verl_padded_batch

    if is_verl_jagged_batch(raw):
        raw = verl_padded_batch(raw, source)  # verl's engine mini-batch: jagged sequences back to padded
    refuse_packed(raw, source)
    if "micro_batches" in raw:
        micro = raw["micro_batches"]
        if not isinstance(micro, (list, tuple)) or not micro:
            raise SnapshotError(f"{source}: 'micro_batches' must be a non-empty list of dicts")
        for i, part in enumerate(micro):
            if not isinstance(part, Mapping) or "micro_batches" in part:
                raise SnapshotError(
                    f"{source}: micro_batches[{i}] must be a dict of tensors (not nested micro_batches)"
                )
        parts = [canonicalize_batch(part, f"{source} micro_batches[{i}]") for i, part in enumerate(micro)]
        merged = _concat_micro_batches(parts, source)
        merged[MICRO_BATCH_ROWS] = torch.tensor([int(p["tokens"].shape[0]) for p in parts], dtype=torch.long)
        merged[MICRO_BATCH_WIDTHS] = torch.tensor([int(p["tokens"].shape[1]) for p in parts], dtype=torch.long)
        return merged

    batch: dict[str, torch.Tensor] = {}
    taken: set[str] = set()
    for canonical in FIELD_ALIASES:
        found = find_field(raw, canonical)
        if found is None:
            continue
        name, value = found
        if not isinstance(value, torch.Tensor):
            raise SnapshotError(f"{source}: field {name!r} must be a tensor, got {type(value).__name__}")
        taken.update(n for n in FIELD_ALIASES[canonical] if n in raw)
        if canonical == "rewards" and name == "token_level_rewards" and value.dim() == 2:
            value = value.sum(dim=-1)
        batch[canonical] = value
    for name in REQUIRED_FIELDS:
        if name not in batch:
            accepted = ", ".join(FIELD_ALIASES[name])
            raise SnapshotError(f"{source}: missing field {name!r} (accepted names: {accepted})")

    tokens = batch["tokens"]
    if tokens.dim() != 2:
        raise SnapshotError(f"{source}: 'tokens' must be [batch, seq], got shape {tuple(tokens.shape)}")
    response_width = batch["loss_mask"].shape[-1] if batch["loss_mask"].dim() == 2 else tokens.shape[1]
    for name in PER_TOKEN_FIELDS:
        if name in batch:
            batch[name] = _right_align(batch[name], tokens.shape, name, source)
    advantages = batch.get("advantages")
    if advantages is not None and advantages.dim() == 2:
        batch["advantages"] = _right_align(advantages, tokens.shape, "advantages", source)
    elif advantages is not None and tuple(advantages.shape) != (tokens.shape[0],):
        raise SnapshotError(
            f"{source}: 'advantages' must be [batch] or [batch, seq], got shape {tuple(advantages.shape)}"
        )
    rewards = batch.get("rewards")
    if rewards is not None and rewards.numel() != tokens.shape[0]:
        raise SnapshotError(f"{source}: 'rewards' must be [batch] or [batch, seq], got shape {tuple(rewards.shape)}")
    for name, value in raw.items():
        if name not in taken and name not in batch:
            batch[name] = value
    weights = batch.get(ROLLOUT_IS_WEIGHTS)
    if isinstance(weights, torch.Tensor) and not weights.is_nested:
        batch[ROLLOUT_IS_WEIGHTS] = _right_align(weights, tokens.shape, ROLLOUT_IS_WEIGHTS, source)
    if response_width < tokens.shape[1]:
        batch[RESPONSE_WIDTH] = torch.tensor(response_width)
    _position_ids(batch, source)
    return batch


PACKED_KEYS = ("cu_seqlens", "cu_seq_lens", "cu_seqlens_q", "cu_seq_lens_q", "max_seqlen", "max_seqlen_in_batch")


def refuse_packed(raw: Mapping[str, Any], source: Path | str) -> None:
    """SnapshotError, naming the file and the field, for packed sequences (several sequences in one row, verl's
    remove-padding layout with `cu_seqlens`, or position ids that restart within a row): replayed as one row, each
    sequence would attend to the ones before it."""
    import torch

    for key in PACKED_KEYS:
        if key in raw:
            raise SnapshotError(
                f"{source}: field {key!r}: packed sequences (verl's use_remove_padding, Megatron's THD) are not "
                "replayed by the torch engine; save the batch padded, one sequence per row (verl's "
                "left_right_2_no_padding inverse), or replay with `--backend command`"
            )
    positions = raw.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.device.type == "meta":  # meta: shapes only, no data
        return
    if positions.dim() == 2 and positions.shape[-1] > 1 and bool((positions.diff(dim=-1) < 0).any()):
        raise SnapshotError(
            f"{source}: field 'position_ids' restarts within a row: packed sequences (verl's use_remove_padding, "
            "Megatron's THD) are not replayed by the torch engine; save the batch padded, one sequence per row, "
            "or replay with `--backend command`"
        )


def _position_ids(batch: dict[str, Any], source: Path | str) -> None:
    """Check `attention_mask` / `position_ids` fit the tokens; count positions from the mask where none are given."""
    import torch

    shape = batch["tokens"].shape
    for name in ("attention_mask", "position_ids"):
        value = batch.get(name)
        if value is None or (isinstance(value, torch.Tensor) and not value.is_nested and value.shape == shape):
            continue
        got = tuple(value.shape) if isinstance(value, torch.Tensor) and not value.is_nested else type(value).__name__
        raise SnapshotError(f"{source}: field {name!r} must be [batch, seq] like the tokens {tuple(shape)}, got {got}")
    attention = batch.get("attention_mask")
    if attention is not None and "position_ids" not in batch:
        batch["position_ids"] = (attention.ne(0).long().cumsum(dim=-1) - 1).clamp(min=0)


def _right_align(value: torch.Tensor, shape: torch.Size, name: str, source: Path | str) -> torch.Tensor:
    import torch

    batch_size, seq_len = shape
    if value.dim() != 2 or value.shape[0] != batch_size or value.shape[1] > seq_len:
        raise SnapshotError(
            f"{source}: field {name!r} has shape {tuple(value.shape)}, expected [{batch_size}, <= {seq_len}]"
        )
    if value.shape[1] == seq_len:
        return value
    pad = torch.zeros(batch_size, seq_len - value.shape[1], dtype=value.dtype, device=value.device)
    return torch.cat([pad, value], dim=1)


def _concat_micro_batches(parts: list[dict[str, torch.Tensor]], source: Path | str) -> dict[str, torch.Tensor]:
    import torch

    keys = set(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if set(part) != keys:
            raise SnapshotError(f"{source}: micro_batches[{i}] has fields {sorted(part)}, expected {sorted(keys)}")
    width = max(part["tokens"].shape[1] for part in parts)
    merged: dict[str, torch.Tensor] = {}
    for key in parts[0]:
        tensors = []
        for part in parts:
            value = part[key]
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] < width:
                pad = torch.zeros(value.shape[0], width - value.shape[1], dtype=value.dtype)
                value = torch.cat([value, pad], dim=1)
            tensors.append(value)
        if all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors):
            merged[key] = torch.stack(tensors).max()  # a per-batch count or width: the widest part's
        elif all(isinstance(t, torch.Tensor) for t in tensors):
            merged[key] = torch.cat(tensors, dim=0)
        else:
            merged[key] = tensors[0]
    return merged
