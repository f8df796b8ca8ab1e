"""The streamed replay's row of a replay plan: its memory on the device, the layer boundaries it keeps on the host
(or spills to disk), the bytes it reads from the checkpoint and an estimate of its time; from shapes only.

A streamed replay (`replay.streamed`) holds at once, on its one device: one decoder layer's parameters and
up to three copies of its gradient (the sum over passes, one saved rank's own, the pass's: as the whole replay's
`Whole` holds them), the next layer's parameters being read ahead (left out, and said, where the row fits only
without it), the embedding and head with their gradient
pieces, one micro-batch's activations inside one layer (`activation_bytes` of a one-layer model: the head's chunk
and eager attention's mask included) and the runtime. The boundaries are per token of every saved rank: each layer's
input hidden states, and per MoE layer the router's float32 logits and its int64 routes, plus, in the backward, one
hidden-state gradient and the router logits' gradients.
It reads every layer once in the forward and once per backward pass (backwards taken together: once), the ends
once.

Split over `processes` (`nproc` > 1: each streams a contiguous block of the saved ranks, `streamed_processes`), the
row is one process's, the one with the largest block: its boundaries are its block's tokens' (and the compute its
block's), while it still holds a layer, the ends, one micro-batch and a runtime of its own and reads every layer
itself, so its peak less its boundaries and its bytes read are the one process's. On CPU the processes share the
host's memory (the row fits when all of them do), on CUDA each has its own GPU. Or the processes split each MoE
layer's routed experts, where only that fits (`expert_plan` chooses, and the row says both peaks).

With mitigations (more than one config) the clean gradient's backwards are counted at their fewest past a spike:
one probe, the pair for the baseline's cosine to clean, and one more (the clean one) beside the other configs, all
of them at once where the host memory left by the forward's boundaries holds a set of backward gradients for each
(`clean_reference.configs_beside`), else in groups that fit (at least pairs); each further probe of the search reads
every layer once more. Backwards taken together read each layer once for all of them (`StreamedWeights.shared_by`)
and each keeps its hidden-state and router gradients, so the backward's boundaries are counted once per backward
taken together (at least twice). Tied input and output embeddings are one
matrix: counted once with the embedding, and its head half of the gradient held from the head to the embedding
(with the ends), each saved rank's own head half kept with the boundaries for the per-rank norms.

The time is an estimate: compute of 2 x active parameters x tokens for the forward, 8 x for each config's backward
(the layer recomputed, then backpropagated), at the `Speeds` given, plus the bytes read at its read speed. Each speed
is measured where the replay would run (`replay.plans.node_speeds`: a bounded read of the checkpoint, a matmul; on
this machine or on an SSH node) or assumed (`speeds.ASSUMED_*`, where nothing was measured: a node described, no GPU
there, no checkpoint file); the row says which, where, and why.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.policy import ModelSpec
from axrl_spike_replay.replay.compute.process_memory import (
    CUDA_CONTEXT_BYTES,
    DTYPE_BYTES,
    RUNTIME_CPU_BYTES,
    ModelFacts,
    activation_bytes,
)
from axrl_spike_replay.replay.streamed.settings import DEFAULT_HOST_BUDGET
from axrl_spike_replay.replay.streamed.speeds import Speeds

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")
_ROUTED = re.compile(r"\.experts\.|\.w_in$|\.w_out$")  # a routed expert's weight (not a shared expert's)


@dataclass(frozen=True)
class ModelPieces:
    """Element counts by piece: the largest decoder layer, the embedding, the rest outside the layers (final norm,
    head), the expert parameters, and the saved bytes per element."""

    largest_layer: int
    layers: int
    embedding: int
    head: int
    experts: int
    saved_bytes: int
    tied: bool = False  # the head's matrix is the embedding's (counted once, with the embedding)
    layer_experts: tuple[tuple[int, int], ...] = ()  # per decoder layer: (its elements, its routed experts')

    def largest_share(self, share: float) -> int:
        """The largest decoder layer's elements with `share` (0 to 1) of its routed experts' (the rest whole)."""
        return max((total - routed + math.ceil(routed * share) for total, routed in self.layer_experts), default=0)


def model_pieces(spec: ModelSpec) -> ModelPieces:
    """The spec's pieces, from its declared shapes (nothing built but a meta layout)."""
    if isinstance(spec, MegatronModelConfig):
        spec = spec.hf
    if isinstance(spec, HFModelConfig):
        from axrl_spike_replay.models.hf_config import expected_hf_shapes

        shapes, dtype = expected_hf_shapes(spec), spec.dtype
        tied = bool(spec.config.get("tie_word_embeddings", False))
    else:
        from axrl_spike_replay.models.tiny_moe import expected_state_shapes

        shapes, dtype = expected_state_shapes(spec), "float32"
        tied = False
    per_layer: dict[int, int] = {}
    routed: dict[int, int] = {}
    embedding = head = experts = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        match = _LAYER.search(name)
        if match:
            layer = int(match.group(1))
            per_layer[layer] = per_layer.get(layer, 0) + n
            if "experts" in name or ".w_in" in name or ".w_out" in name:
                experts += n
            if _ROUTED.search(name):
                routed[layer] = routed.get(layer, 0) + n
        elif "embed" in name or name.startswith("pos."):
            embedding += n
        elif not (tied and name.startswith("lm_head.")):
            head += n
    layers = tuple((per_layer[i], routed.get(i, 0)) for i in sorted(per_layer))
    largest = max(per_layer.values(), default=0)
    return ModelPieces(largest, len(per_layer), embedding, head, experts, DTYPE_BYTES.get(dtype, 4), tied, layers)


@dataclass
class StreamedRow:
    """The streamed replay in bytes and seconds (see the module docstring)."""

    device_peak: int  # on the one device (GPU, or the host for a CPU replay, boundaries in memory up to the budget)
    layer: int  # one layer's parameters and gradient copies, and the next layer's parameters read ahead
    ends: int  # embedding and head, with their gradient pieces
    activations: int  # one micro-batch inside one layer
    runtime: int
    boundaries: int  # the step's layer boundaries (host memory up to the budget, then disk)
    host_budget: int
    disk: int  # boundaries over the budget, spilled
    bytes_read: int  # from the checkpoint, forward and every config's backward
    layer_reads: int
    flops: float
    seconds: float  # estimated
    speeds: str  # the speeds of the estimate, and whether each was measured or assumed
    fits: bool | None
    read_ahead: bool = True  # the next layer read during this one's compute (left out where only that fits)
    processes: int = 1  # the row is one process's of these (each a block of the saved ranks)
    ranks_each: int = 0  # saved ranks in that process's block (0: unknown, an older row)
    read_bytes_per_s: float = 0.0  # seconds = bytes_read / read_bytes_per_s + flops / flops_per_s
    flops_per_s: float = 0.0
    read_measured: bool = False
    compute_measured: bool = False
    read_cached: bool | None = None  # the measured read came from the page cache
    split: str = "ranks"  # over the processes: "ranks" (each a block of the saved ranks) or "experts" (`expert_plan`)
    ranks_peak: int = 0  # the device peak per process split by saved ranks (0: one process, no split)
    experts_peak: int = 0  # ... split by each MoE layer's routed experts (0: one process, or no routed experts)
    experts_refused: str = ""  # why this model's experts do not split ("": they do)

    def text(self) -> str:
        """The row in one line."""
        fits = {True: "fits", False: "DOES NOT FIT", None: "capacity unknown"}[self.fits]
        ahead = "layer and the next read ahead" if self.read_ahead else "layer, no read ahead: it would not fit"
        who = "1 process, every saved rank"
        if self.processes > 1 and self.split == "experts":
            who = f"{self.processes} processes, each every saved rank and 1/{self.processes} of each MoE layer's "
            who += "routed experts; per process"
        elif self.processes > 1:
            who = f"{self.processes} processes, each up to {self.ranks_each} saved rank(s); per process"
        return (
            f"streamed ({who}, one decoder layer at a time): device peak {_gib(self.device_peak)} "
            f"({ahead} {_gib(self.layer)}, embedding and head {_gib(self.ends)}, one micro-batch in one layer "
            f"{_gib(self.activations)}, runtime {_gib(self.runtime)}); boundaries {_gib(self.boundaries)} "
            f"(host up to {_gib(self.host_budget)}, disk {_gib(self.disk)}); reads {_gib(self.bytes_read)} from the "
            f"checkpoint ({self.layer_reads} layer reads); about {_duration(self.seconds)} ({self.speeds}): {fits}"
            + self._splits()
        )

    def _splits(self) -> str:
        """Both splits' peaks per process, and the one chosen (nothing for one process)."""
        if self.processes < 2:
            return ""
        experts = "not counted (no routed experts)" if not self.experts_peak else _gib(self.experts_peak)
        if self.experts_refused:
            experts += f", not available: {self.experts_refused}"
        said = f"; split over {self.processes} processes: saved ranks {_gib(self.ranks_peak)} per process, "
        said += f"each MoE layer's routed experts {experts}: "
        if self.fits is False:
            return said + "neither fits"
        return said + ("the experts split chosen" if self.split == "experts" else "the saved-ranks split chosen")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def streamed_row(
    facts: ModelFacts,
    pieces: ModelPieces,
    *,
    world: int,
    rank_tokens: int,
    micro_batch: tuple[int, int],
    device: str,
    configs: int,
    capacity_bytes: int | None,
    host_budget: int = DEFAULT_HOST_BUDGET,
    speeds: Speeds | None = None,
    element: int = 4,
    processes: int = 1,
    sharing: int = 1,
) -> StreamedRow:
    """The streamed row for a step of `world` saved ranks of `rank_tokens` tokens each (see the module docstring), one
    process's of `processes`; `sharing` of them share the memory of `capacity_bytes` (the host on CPU, a GPU). Its
    time at `speeds` (default: the assumed ones for `device`)."""
    ranks_each = math.ceil(world / max(processes, 1))  # the first block is the largest (`contiguous_blocks`)
    if capacity_bytes is not None:
        capacity_bytes //= max(sharing, 1)
    b = element  # the compute dtype's bytes
    layer = pieces.largest_layer * b * 4  # parameters and three gradient copies
    ends = (pieces.embedding + pieces.head) * b + 3 * max(pieces.embedding, pieces.head) * b
    ends += pieces.embedding * b if pieces.tied else 0  # the tied matrix's head half, held until the embedding
    one_layer = dataclasses.replace(facts, layers=1, dense_layers=0 if facts.experts else 1)
    activations = activation_bytes(one_layer, micro_batch[0], micro_batch[1], b, attention=facts.attention)
    runtime = CUDA_CONTEXT_BYTES if device == "cuda" else RUNTIME_CPU_BYTES
    moe_layers = facts.layers - facts.dense_layers
    tokens = ranks_each * rank_tokens
    per_token = (facts.layers + 1) * facts.hidden * b + moe_layers * (facts.experts * b + facts.top_k * 8)
    forward = tokens * per_token + (ranks_each * pieces.embedding * b if pieces.tied else 0)
    gradients = tokens * (facts.hidden * b + moe_layers * facts.experts * b)  # one backward's, until it ends
    others = configs - 1
    # the mitigated configs beside one clean backward: as many as the host memory left holds (`configs_beside`)
    beside = max(1, min(others, (host_budget - min(forward, host_budget)) // max(gradients, 1) - 1)) if others else 0
    groups = math.ceil(others / beside) if others else 0
    boundaries = forward + (max(2, 1 + beside) if others else 1) * gradients
    held = min(boundaries, host_budget)
    peak = layer + ends + activations + runtime + (held if device != "cuda" else 0)
    ahead = pieces.largest_layer * b  # the next layer's parameters, read while this one computes
    read_ahead = capacity_bytes is None or peak + ahead <= capacity_bytes or peak > capacity_bytes
    if read_ahead:
        layer, peak = layer + ahead, peak + ahead
    # the clean gradient's at their fewest past a spike: one probe, the baseline's pair, one beside each group
    backwards = configs + (3 + groups if others else 0)
    layer_reads = pieces.layers * (1 + (1 + 1 + 1 + groups if others else 1))  # backwards taken together: one read
    read = (pieces.embedding + pieces.head + pieces.largest_layer * layer_reads) * pieces.saved_bytes
    active = facts.parameters - pieces.experts * (1 - facts.top_k / facts.experts if facts.experts else 0)
    flops = float(active) * tokens * (2 + 8 * backwards)
    speeds = speeds or Speeds.assumed(device)
    return StreamedRow(
        device_peak=peak,
        layer=layer,
        ends=ends,
        activations=activations,
        runtime=runtime,
        boundaries=boundaries,
        host_budget=host_budget,
        disk=boundaries - held,
        bytes_read=read,
        layer_reads=layer_reads,
        flops=flops,
        seconds=read / speeds.read_bytes_per_s + flops / speeds.flops_per_s,
        speeds=speeds.text(),
        fits=None if capacity_bytes is None else peak <= capacity_bytes,
        read_ahead=read_ahead,
        processes=processes,
        ranks_each=ranks_each,
        read_bytes_per_s=speeds.read_bytes_per_s,
        flops_per_s=speeds.flops_per_s,
        read_measured=speeds.read_measured,
        compute_measured=speeds.compute_measured,
        read_cached=speeds.read_cached,
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
