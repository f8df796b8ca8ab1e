"""The streamed row's choice of how its processes split the work: the saved ranks (each process one block of them and
a whole layer at a time, `streamed_processes`) or each MoE layer's routed experts (`expert_share`).

Split by experts, each of N processes holds the layer's non-expert parts whole and the largest block of its routed
experts (ceil(E / N) of E) with their gradient copies, and streams every saved rank: its boundaries and compute are
every saved rank's, its micro-batch's activations as a whole layer's (every token passes every process's attention).
The row is the saved-ranks one where that fits each device (or the capacity is unknown), the experts one where it
does not and that does, and the saved-ranks one (not fitting: neither does) otherwise. Both peaks per process are
kept in the row (`ranks_peak`, `experts_peak`), and where the model's experts do not split (`check_expert_split`:
another architecture, a Megatron checkpoint) why, said from the model's config alone: a checkpoint saving one
tensor per expert is refused when the replay reads it.
"""

from __future__ import annotations

import dataclasses
import math

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.policy import ModelSpec
from axrl_spike_replay.replay.compute.process_memory import ModelFacts
from axrl_spike_replay.replay.streamed.expert_share import check_expert_split
from axrl_spike_replay.replay.streamed.speeds import Speeds
from axrl_spike_replay.replay.streamed.streamed_plan import ModelPieces, StreamedRow, streamed_row


def expert_refusal(spec: ModelSpec, processes: int) -> str:
    """Why `spec`'s experts do not split over `processes` ("": they do)."""
    try:
        check_expert_split(spec, processes)
    except ConfigError as exc:
        return str(exc).removeprefix("`nproc`: ").removesuffix("; split the saved ranks instead")
    return ""


def planned_row(
    spec: ModelSpec,
    facts: ModelFacts,
    pieces: ModelPieces,
    *,
    world: int,
    rank_tokens: int,
    micro_batch: tuple[int, int],
    device: str,
    configs: int,
    capacity_bytes: int | None,
    speeds: Speeds | None,
    element: int,
    processes: int,
    sharing: int,
) -> StreamedRow:
    """The streamed row over `processes` with its split chosen (see the module docstring); `streamed_row`'s
    arguments."""
    common = {
        "world": world,
        "rank_tokens": rank_tokens,
        "micro_batch": micro_batch,
        "device": device,
        "configs": configs,
        "capacity_bytes": capacity_bytes,
        "speeds": speeds,
        "element": element,
        "sharing": sharing,
    }
    ranks = streamed_row(facts, pieces, processes=processes, **common)
    routed = sum(r for _, r in pieces.layer_experts)
    if processes < 2 or not routed or not facts.experts:
        return ranks
    share = math.ceil(facts.experts / processes) / facts.experts  # the largest block of experts
    split = dataclasses.replace(pieces, largest_layer=pieces.largest_share(share))
    experts = streamed_row(facts, split, processes=1, **common)  # every saved rank's tokens in each process
    refused = expert_refusal(spec, processes)
    figures = {"ranks_peak": ranks.device_peak, "experts_peak": experts.device_peak, "experts_refused": refused}
    if ranks.fits is not False or refused or experts.fits is not True:
        return dataclasses.replace(ranks, **figures)
    return dataclasses.replace(experts, processes=processes, split="experts", **figures)
