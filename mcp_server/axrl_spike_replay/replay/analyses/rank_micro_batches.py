"""A saved rank's forward and loss micro-batch by micro-batch, kept on one graph, for the analyses of a rank's loss.

The replay itself (`rank_passes.forward_group`) forwards and backpropagates one micro-batch at a time, and so do the
analyses of a rank's loss that take gradients (attribution, diagnose's loss-term channel): `micro_forwards` gives
each micro-batch's forward in turn, `micro_loss` its loss as the trainer computed it, and the caller takes its
backward(s) and drops the graph before the next: a process's peak holds one micro-batch's activations, as the
plan counts. A rank's loss is linear in its micro-batches' scaled losses, so every gradient (of the loss, of a
term, of dLoss/dlogprobs at a token) is the sum of the micro-batches' own.

`rank_forward` / `rank_loss_of` keep the rank's whole graph: every micro-batch of the rank's plan forwarded as the
trainer ran it (its rows, its width, its routes), the outputs put back at their rows of the rank's `[B, T]`
tensors, and the loss the micro-batches' losses on those rows, each scaled as the trainer scaled it
(`training.micro_batches`), summed. Used without gradients (the signal check's no-grad forwards hold no graph) and
as the whole-graph reference the micro-batch path is tested against.

FSDP2's collectives need every process to make the same number of forwards: a sharded analysis whose processes'
ranks hold different numbers of micro-batches is refused by name (`check_same_counts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.models.policy import policy_forward
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, loss_batch
from axrl_spike_replay.replay.compute.rank_passes import rank_step_metrics
from axrl_spike_replay.training.micro_batches import MicroBatch, stitch, take, take_routing
from axrl_spike_replay.training.policy_loss import LossOutput


@dataclass
class RankOutput:
    """A rank's forward over its micro-batches: per-token outputs at the rank's rows (on the graph), the router
    losses as the micro-batches' scaled sum, and each micro-batch's own output."""

    logprobs: torch.Tensor  # [B, T]
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    routes: torch.Tensor  # [B, T, L, K]; -1 where a micro-batch narrower than the rank had no token
    plan: list[MicroBatch]
    parts: list[Any]  # each micro-batch's policy output


@dataclass
class _View:
    """One micro-batch's outputs as a loss reads them (cut from the rank's, so gradients reach the rank's)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


def _whole(mb: MicroBatch, batch: dict[str, torch.Tensor]) -> bool:
    size, width = batch["tokens"].shape[:2]
    return mb.rows == tuple(range(size)) and mb.width == width


def rank_forward(
    model: torch.nn.Module, inputs: RankInputs, cfg: AppliedConfig, rank: int, need_entropy: bool, control: Any = None
) -> RankOutput:
    """Saved rank `rank`'s forward, micro-batch by micro-batch under the config's routing (or `control`)."""
    saved = inputs.batches[rank]
    plan = inputs.plan(rank)
    control = inputs.routing(cfg, rank) if control is None else control
    size, width = int(saved["tokens"].shape[0]), int(saved["tokens"].shape[1])
    parts = [
        policy_forward(model, take(saved, mb), take_routing(control, mb, size), need_entropy=need_entropy)
        for mb in plan
    ]
    if len(plan) == 1 and _whole(plan[0], saved):
        out = parts[0]
        return RankOutput(out.logprobs, out.entropy, out.aux_loss, out.z_loss, out.routes, plan, parts)
    entropies = [p.entropy for p in parts if p.entropy is not None]
    entropy = stitch(entropies, plan, size, width) if len(entropies) == len(parts) else None
    return RankOutput(
        logprobs=stitch([p.logprobs for p in parts], plan, size, width),
        entropy=entropy,
        aux_loss=_scaled_sum([p.aux_loss for p in parts], plan),
        z_loss=_scaled_sum([p.z_loss for p in parts], plan),
        routes=stitch([p.routes for p in parts], plan, size, width, fill=-1),
        plan=plan,
        parts=parts,
    )


def micro_forwards(
    model: torch.nn.Module, inputs: RankInputs, cfg: AppliedConfig, rank: int, need_entropy: bool, control: Any = None
) -> Iterator[tuple[MicroBatch, Any]]:
    """Saved rank `rank`'s micro-batches, each with its forward (on the graph), one at a time: the caller takes its
    backward(s) and lets it go before asking for the next."""
    saved = inputs.batches[rank]
    control = inputs.routing(cfg, rank) if control is None else control
    size = int(saved["tokens"].shape[0])
    for mb in inputs.plan(rank):
        yield mb, policy_forward(model, take(saved, mb), take_routing(control, mb, size), need_entropy=need_entropy)


def micro_loss(
    part: Any,
    saved: dict[str, torch.Tensor],
    rank: int,
    cfg: AppliedConfig,
    mb: MicroBatch,
    loss: Callable[[Any, dict[str, Any]], LossOutput],
) -> LossOutput:
    """One micro-batch's loss from its forward `part`, unscaled (the trainer multiplies it by `mb.scale`): `loss`
    on its outputs and its batch as `process_inputs.loss_batch` cuts it."""
    view = _View(part.logprobs, part.entropy, part.aux_loss, part.z_loss)
    return loss(view, loss_batch(saved, rank, cfg, part.logprobs, mb))


def joined_loss(results: Sequence[LossOutput], plan: Sequence[MicroBatch], size: int, width: int) -> LossOutput:
    """A rank's loss from its micro-batches' (in plan order): losses scaled and summed, per-token figures at the
    rank's rows; the figures as `rank_loss_of` gives them (detach the parts first to hold no graph)."""
    return LossOutput(
        loss=_scaled_sum([r.loss for r in results], plan),
        policy_loss=_scaled_sum([r.policy_loss for r in results], plan),
        per_token=stitch([r.per_token for r in results], plan, size, width),
        mask=stitch([r.mask for r in results], plan, size, width),
        metrics={
            k: v
            for k, v in rank_step_metrics([(r, mb.scale) for r, mb in zip(results, plan, strict=True)]).items()
            if k != "loss"
        },
    )


def _scaled_sum(values: Sequence[torch.Tensor], plan: Sequence[MicroBatch]) -> torch.Tensor:
    total = values[0] * plan[0].scale
    for value, mb in zip(values[1:], plan[1:], strict=True):
        total = total + value * mb.scale
    return total


def _cut(value: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    return value.index_select(0, torch.tensor(mb.rows, dtype=torch.long, device=value.device))[:, : mb.width]


def rank_loss_of(
    out: RankOutput,
    saved: dict[str, torch.Tensor],
    rank: int,
    cfg: AppliedConfig,
    loss: Callable[[Any, dict[str, Any]], LossOutput],
) -> LossOutput:
    """The rank's loss from its forward `out`: `loss(view, batch)` on each micro-batch (its outputs cut from the
    rank's, its batch as `process_inputs.loss_batch` gives it), scaled and summed; per-token figures at the rank's rows.
    One micro-batch: `loss` on the whole forward, as it is."""
    if len(out.plan) == 1 and _whole(out.plan[0], saved):
        part = out.parts[0]
        view = _View(out.logprobs, out.entropy, part.aux_loss, part.z_loss)
        return loss(view, loss_batch(saved, rank, cfg, out.logprobs))
    results: list[LossOutput] = []
    for mb, part in zip(out.plan, out.parts, strict=True):
        logprobs = _cut(out.logprobs, mb)
        entropy = _cut(out.entropy, mb) if out.entropy is not None else None
        view = _View(logprobs, entropy, part.aux_loss, part.z_loss)
        results.append(loss(view, loss_batch(saved, rank, cfg, logprobs, mb)))
    size, width = int(saved["tokens"].shape[0]), int(saved["tokens"].shape[1])
    return joined_loss(results, out.plan, size, width)


def check_same_counts(inputs: RankInputs, passes: Sequence[int | None], what: str, device: str) -> None:
    """ConfigError on every process (an all-reduce: each calls it together) unless every pass of every process
    forwards the same number of micro-batches: FSDP2's collectives would go out of step."""
    import torch.distributed as dist

    counts = [len(inputs.plan(rank)) for rank in passes if rank is not None] or [1]
    spread = torch.tensor([max(counts), -min(counts)], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    most, fewest = int(spread[0]), -int(spread[1])
    if most != fewest:
        raise ConfigError(
            f"{what} sharded over processes needs every saved rank split into the same number of micro-batches "
            f"(these hold {fewest} to {most}); run it with `shard` off, where each process holds the whole model"
        )
