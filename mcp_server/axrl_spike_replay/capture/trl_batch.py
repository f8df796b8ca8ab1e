"""A TRL `GRPOTrainer` micro-batch as a snapshot holds it: the inputs `_compute_loss` consumed, in our batch layout,
and the routes an MoE policy's routers took on that forward (recorded by hooks: TRL's models have no router replay).

TRL's inputs are a left-padded prompt and a right-padded completion (`prompt_ids`/`prompt_mask`,
`completion_ids`/`completion_mask`) with per-completion-token fields; ours are one `tokens` row (prompt +
completion) with a `loss_mask` on the completion (times TRL's `tool_mask`), the per-token fields right-aligned to
it as the snapshot reader does, and the `position_ids` TRL's forward used (transformers counts them 0..T-1 when
none are given, padding included). TRL's own names are kept for what only the trl convention reads
(`importance_sampling_ratio`, `num_items_in_batch`) and each row carries its micro-batch's index (`micro_batch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from axrl_spike_replay.training.trl_convention import IS_RATIO, MICRO_BATCH, NUM_ITEMS

# TRL input -> our field (per completion token, right-aligned by the snapshot reader)
_PER_TOKEN = {
    "old_per_token_logps": "old_logprobs",
    "ref_per_token_logps": "ref_logprobs",
    "sampling_per_token_logps": "rollout_logprobs",
}
# inputs that reach TRL's loss but not ours: a snapshot naming them is refused at replay (`loss.unreproduced`)
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids")


def micro_batch_fields(inputs: Mapping[str, Any], index: int) -> dict[str, torch.Tensor]:
    """One micro-batch's TRL inputs as snapshot batch fields (detached, on the CPU)."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    loss_on = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    tokens = torch.cat([prompt_ids, completion_ids], dim=1)
    rows, width = tokens.shape
    out: dict[str, torch.Tensor] = {
        "tokens": tokens,
        "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
        "position_ids": torch.arange(width).expand(rows, width).clone(),
        "loss_mask": torch.cat([torch.zeros_like(prompt_mask), loss_on.to(prompt_mask.dtype)], dim=1),
        "advantages": inputs["advantages"],
        MICRO_BATCH: torch.full((rows,), index, dtype=torch.long),
    }
    for theirs, ours in _PER_TOKEN.items():
        if inputs.get(theirs) is not None:
            out[ours] = inputs[theirs]
    if inputs.get(IS_RATIO) is not None:
        out[IS_RATIO] = inputs[IS_RATIO]
    if inputs.get(NUM_ITEMS) is not None:
        out[NUM_ITEMS] = torch.as_tensor(inputs[NUM_ITEMS]).reshape(())
    return {k: v.detach().cpu() for k, v in out.items()}


def multimodal_inputs(inputs: Mapping[str, Any]) -> list[str]:
    """The multimodal inputs a micro-batch carries (the torch replay builds text-only policies)."""
    return [name for name in MULTIMODAL_INPUTS if inputs.get(name) is not None]


@dataclass
class RouteTape:
    """Routes of the loss forwards since the last optimizer step: per micro-batch, {layer: [N, K] expert ids}."""

    layers: tuple[int, ...] = ()
    recording: bool = False
    current: dict[int, torch.Tensor] = field(default_factory=dict)
    micro_batches: list[dict[int, torch.Tensor]] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)

    def begin(self) -> None:
        self.current, self.recording = {}, True

    def end(self) -> None:
        if self.recording:
            self.micro_batches.append(self.current)
        self.current, self.recording = {}, False

    def clear(self) -> None:
        self.current, self.micro_batches, self.recording = {}, [], False


def install_route_tape(model: nn.Module) -> RouteTape:
    """Forward hooks on an MoE policy's routers that record the chosen experts while `tape.recording` (the loss's
    forwards only, not generation's); an empty tape for a model our architectures do not declare."""
    from axrl_spike_replay.models.architectures import ARCHITECTURES
    from axrl_spike_replay.models.hf_routing import find_routers

    architecture = str(getattr(getattr(model, "config", None), "model_type", ""))
    if architecture not in ARCHITECTURES:
        return RouteTape()
    routers = find_routers(model, architecture)
    tape = RouteTape(layers=tuple(sorted(routers)))
    for layer, router in routers.items():

        def hook(module: nn.Module, args: Any, output: Any, layer: int = layer) -> None:
            if tape.recording and isinstance(output, tuple) and len(output) == 3:
                tape.current[layer] = output[2].detach()

        tape.handles.append(router.register_forward_hook(hook))
    return tape


def routing_payload(tape: RouteTape, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any] | None:
    """`routed_experts` [B, T, L, K] over the step's micro-batches (-1 where a token was not attended, or on
    padding between micro-batches), `moe_layers`, `source: train`; None when no route was recorded for each."""
    if not tape.layers or len(tape.micro_batches) != len(batches):
        return None
    width = max(b["tokens"].shape[1] for b in batches)
    parts = []
    for routes, batch in zip(tape.micro_batches, batches, strict=True):
        rows, cols = batch["tokens"].shape
        if set(routes) != set(tape.layers):
            return None
        stacked = torch.stack([routes[layer].reshape(rows, cols, -1) for layer in tape.layers], dim=2).long().cpu()
        stacked = stacked.masked_fill(batch["attention_mask"][:, :, None, None] == 0, -1)
        pad = torch.full((rows, width - cols, *stacked.shape[2:]), -1, dtype=torch.long)
        parts.append(torch.cat([stacked, pad], dim=1))
    return {"routed_experts": torch.cat(parts), "moe_layers": list(tape.layers), "source": "train"}
