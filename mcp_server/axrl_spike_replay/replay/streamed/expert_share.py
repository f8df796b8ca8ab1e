"""Each MoE layer's routed experts split over a streamed replay's processes (expert parallel within a layer).

With P processes, process p holds a contiguous block of every MoE layer's routed experts: experts
[p * E // P, (p + 1) * E // P) of E, read from the checkpoint as those rows of the stacked expert weights, and only
those (1/P of the layer's expert weights and of their gradient). Every process streams every saved rank and
computes the rest of the layer (attention, norms, router) itself, alike: the routes are the recorded (or forced)
ones, the same in every process. In the MoE block each process computes its own experts' contributions to the
tokens routed to them, and the block's routed output is their sum over processes.

Two autograd functions make that sum (Megatron's pair for a split layer): `_Summed` all-reduces the partial outputs
in the forward and hands the output's gradient to each process's experts unchanged in the backward; `_Spread`
hands the block's input (and the routing weights) to the experts unchanged in the forward and all-reduces their
gradients in the backward, so every process's input gradient (and router gradient) is the whole one. The
autograd-aware `torch.distributed.nn.functional.all_reduce` sums the output's gradient in its backward too: right
where each process computes its own share of the loss, P times the gradient here, where every process computes the
whole loss.

A split parameter's gradient lives on its owner only. The step's figures are put together after each backward
(`merged`, every process gathering every process's): a split parameter's float64 sum of squares is the sum of its
owners' and its norm (each saved rank's too) the root of the sum of their squares, each part's norm taken from its
float64 sum of squares (`PieceGradient.precise`); every other parameter's are process 0's (the same in every
process). A dot product of two gradients (`PieceDots`) counts each split parameter in its owner and every other in
process 0, summed over processes (`summed`). The input gradients are summed in another order than the one
process's: the figures agree with it to rounding (the tests: 1e-6 relative), not bit for bit. A split parameter's
norms are float64 ones where the one process takes the trainer's float32 norm, itself a few 1e-6 off the float64
one on a tensor of some 10^5 elements: against the same code with every expert in one process they agree to 1e-6.
In a recorded bf16 precision each process's partial output and input gradient are bf16 tensors before they are
summed, rounded apart where one process's einsum over every expert rounds once: the figures then agree at bf16's
rounding (measured: tiny_moe's grad norm 1.2e-5 apart, one parameter's norm 4e-3; qwen3_moe, whose experts add up
one at a time in bf16 anyway, its grad norm bit for bit).

Built for tiny_moe (`MoEFeedForward`: stacked `w_in`, `w_out`) and the transformers architectures whose experts are
stacked `gate_up_proj` and `down_proj` weights called with each token's routes and routing weights (qwen2_moe, its
shared expert computed by every process, and qwen3_moe): their experts' eager forward, over this process's experts,
stands in for theirs (the one process computes with the recorded experts implementation: eager in the tests). Such
a checkpoint must hold the stacked tensors (a DCP snapshot of the model's state); one saved per expert is refused,
as is any other architecture and a Megatron checkpoint, by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.policy import ModelSpec
from axrl_spike_replay.models.tiny_moe import MoEFeedForward, TinyMoEConfig
from axrl_spike_replay.replay.compute.rank_passes import gather_objects
from axrl_spike_replay.replay.streamed.layer_gradients import StepFigures

_EXPERT_WEIGHTS = ("w_in", "w_out")  # MoEFeedForward's stacked expert weights, experts along dim 0
_HF_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # a transformers experts module's, experts along dim 0
HF_ARCHITECTURES = ("qwen2_moe", "qwen3_moe")  # transformers architectures whose experts split
_HF_EXPERTS = ("Qwen2MoeExperts", "Qwen3MoeExperts")


def check_expert_split(spec: ModelSpec, processes: int) -> int:
    """ConfigError (naming `nproc`) unless `spec`'s experts split over `processes`: the experts per MoE layer."""
    if isinstance(spec, TinyMoEConfig):
        experts = spec.n_experts
    elif isinstance(spec, HFModelConfig) and spec.architecture in HF_ARCHITECTURES:
        experts = int(spec.config.get("num_experts", 0))
    else:
        if isinstance(spec, MegatronModelConfig):
            what = "a Megatron checkpoint (its expert weights are read through route 1's mapping)"
        else:
            what = getattr(spec, "architecture", None) or type(spec).__name__
        raise ConfigError(
            f"`nproc`: splitting each layer's experts over processes is built for tiny_moe, "
            f"{' and '.join(HF_ARCHITECTURES)}, not {what}; split the saved ranks instead",
            "nproc",
        )
    if not 1 <= processes <= experts:
        raise ConfigError(
            f"`nproc`: {experts} experts per layer split over 1 to {experts} processes, not {processes}", "nproc"
        )
    return experts


@dataclass(frozen=True)
class ExpertShare:
    """Process `process` of `processes`, each holding a contiguous block of every MoE layer's experts."""

    process: int
    processes: int

    def rows(self, n_experts: int) -> tuple[int, int]:
        """[first, end) of this process's experts among `n_experts`."""
        return self.process * n_experts // self.processes, (self.process + 1) * n_experts // self.processes

    def counts(self, name: str, split: set[str] | dict[str, Any]) -> bool:
        """Whether this process counts parameter `name` in a sum over processes: its own split part, or process 0."""
        return name in split or self.process == 0

    def summed(self, values: list[float]) -> list[float]:
        """Each of `values` summed over every process (a collective), in process order: alike in every process."""
        parts = gather_objects(list(values))
        return [math.fsum(part[i] for part in parts) for i in range(len(values))]

    def merged(self, figures: StepFigures, split: set[str] | dict[str, Any]) -> StepFigures:
        """The step's figures from every process's (a collective; see the module docstring)."""
        parts: list[tuple[dict[str, float], dict[str, float], dict[int, dict[str, float]]]] = gather_objects(
            (figures.squares, figures.norms, figures.rank_norms)
        )
        squares, norms, ranks = parts[0]
        out = StepFigures(dict(squares), dict(norms), {rank: dict(n) for rank, n in ranks.items()})
        for name in out.squares.keys() & split:
            out.squares[name] = math.fsum(part[0][name] for part in parts)
        for name in out.norms.keys() & split:
            out.norms[name] = _root([part[1][name] for part in parts])
        for rank, own in out.rank_norms.items():
            for name in own.keys() & split:
                own[name] = _root([part[2][rank][name] for part in parts])
        return out


def _root(norms: list[float]) -> float:
    return math.sqrt(math.fsum(n * n for n in norms))


@dataclass(frozen=True)
class SplitRows:
    """A split parameter: rows [first, end) of the saved tensor of `shape` are this process's."""

    first: int
    end: int
    shape: tuple[int, ...]


def split_experts(policy: nn.Module, share: ExpertShare) -> dict[str, SplitRows]:
    """Give each MoE layer of `policy` (on the meta device) this process's block of experts: its stacked expert
    weights shortened to those rows, its forward the split one; the split parameters by name."""
    split: dict[str, SplitRows] = {}
    for prefix, module in policy.named_modules():
        if isinstance(module, MoEFeedForward):
            leaves, forward, experts = _EXPERT_WEIGHTS, _split_forward, module.n_experts
        elif type(module).__name__ in _HF_EXPERTS:
            leaves, forward, experts = _HF_EXPERT_WEIGHTS, _split_hf_forward, int(getattr(module, "num_experts"))  # noqa: B009 - transformers' module, untyped
        else:
            continue
        first, end = share.rows(experts)
        for leaf in leaves:
            whole = getattr(module, leaf)
            split[f"{prefix}.{leaf}"] = SplitRows(first, end, tuple(whole.shape))
            part = torch.empty((end - first, *whole.shape[1:]), dtype=whole.dtype, device=whole.device)
            setattr(module, leaf, nn.Parameter(part, requires_grad=whole.requires_grad))
        setattr(module, "forward", partial(forward, module, first, end))  # noqa: B010 - this instance's forward
    return split


class _Summed(torch.autograd.Function):
    """All-reduce (sum) forward, the gradient unchanged backward."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        total = part.contiguous().clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return grads[0]


class _Spread(torch.autograd.Function):
    """The inputs unchanged forward, their gradients all-reduced (sum) backward, in one fixed order."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone(), gates.clone()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        import torch.distributed as dist

        summed = tuple(g.contiguous().clone() for g in grads)  # the input's, then the routing weights'
        for g in summed:
            dist.all_reduce(g)
        return summed


def _split_forward(
    ffn: MoEFeedForward,
    first: int,
    end: int,
    x: torch.Tensor,
    replay: torch.Tensor | None,
    replay_tokens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`MoEFeedForward.forward` with experts [first, end) here and the routed output summed over processes."""
    batch, seq, dim = x.shape
    scores = ffn.router(x)
    probs = scores.float().softmax(dim=-1)
    chosen = probs.topk(ffn.top_k, dim=-1).indices
    if replay is not None:
        use = replay >= 0
        if replay_tokens is not None:
            use = use & replay_tokens[..., None]
        chosen = torch.where(use, replay.clamp(min=0), chosen)
    gates = probs.gather(-1, chosen)
    gates = (gates / gates.sum(dim=-1, keepdim=True)).to(x.dtype)
    spread_x, spread_gates = _Spread.apply(x, gates)
    hidden = F.gelu(torch.einsum("btd,edf->btef", spread_x, ffn.w_in))
    expert_out = torch.einsum("btef,efd->bted", hidden, ffn.w_out)  # [B, T, own experts, D]
    local = chosen - first
    mine = (local >= 0) & (local < end - first)
    picked = expert_out.gather(2, local.clamp(0, end - first - 1)[..., None].expand(batch, seq, ffn.top_k, dim))
    weighted = torch.where(mine[..., None], picked * spread_gates[..., None], picked.new_zeros(()))
    out = _Summed.apply(weighted.sum(dim=2))
    load = F.one_hot(chosen, ffn.n_experts).float().sum(dim=2).mean(dim=(0, 1)) / ffn.top_k
    aux = ffn.n_experts * (load * probs.mean(dim=(0, 1))).sum()
    z_loss = torch.logsumexp(scores.float(), dim=-1).pow(2).mean()
    return out, aux, z_loss, chosen


def _split_hf_forward(
    experts: Any, first: int, end: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: Any
) -> torch.Tensor:
    """A transformers experts module's eager forward over experts [first, end) here, the output summed over
    processes: each expert on the tokens routed to it, weighted, added at those tokens."""
    x, weights = _Spread.apply(hidden_states, top_k_weights)
    # both tied into the graph where no token comes to these experts: every process's backward all-reduces alike
    out = torch.zeros_like(x) + (x[:0].sum() + weights[:0].sum().to(x.dtype))
    count = end - first
    with torch.no_grad():
        local = top_k_index - first
        local = torch.where((local >= 0) & (local < count), local, count)  # another process's expert: `count`
        expert_mask = F.one_hot(local, num_classes=count + 1).permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for found in hit:
        expert = int(found[0])
        if expert == count:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        gate, up = F.linear(x[token_idx], experts.gate_up_proj[expert]).chunk(2, dim=-1)
        hidden = F.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
        hidden = hidden * weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, hidden.to(out.dtype))
    return _Summed.apply(out)
