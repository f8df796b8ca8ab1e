"""The reference trainer's rank under FSDP2: the policy sharded with `fully_shard`, weights saved as a sharded DCP.

This is the path a verl / FSDP user's weights take. The policy is wrapped with
`torch.distributed.fsdp.fully_shard` (parameters become `Shard(0)` DTensors over the data-parallel
mesh); the backward reduce-scatters the gradients with FSDP's own mean, and a snapshot's weights are
the sharded state dict of `torch.distributed.checkpoint.state_dict.get_model_state_dict`, which DCP
writes as one chunk per rank. A replay loads them unsharded (or resharded to its own layout).

The guard's grad norm is the same statistic as under DDP: fp64 sum of squares over the full gradients
(each gathered with `full_tensor()`), so a full-fidelity replay is compared bit for bit. What FSDP's
own clip would report (`torch.nn.utils.get_total_norm` over the sharded DTensor gradients, fp32) is
recorded beside it in the grad info as `fsdp_total_norm`.
"""

from __future__ import annotations

import math

import torch

from axrl_spike_replay.capture.reference.run_config import RunSpec
from axrl_spike_replay.capture.reference.trainer_step import RankTrainer, StepBatch, StepGrads, all_reduce_sum
from axrl_spike_replay.capture.snapshot_writer import RankPayload
from axrl_spike_replay.models.policy import build_policy
from axrl_spike_replay.training.rank_step import rank_forward_backward
from axrl_spike_replay.training.routing_replay import routing_control


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective), the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class FsdpRankTrainer(RankTrainer):
    """A data-parallel rank whose policy is sharded with FSDP2 over the default (gloo) process group."""

    def __init__(self, spec: RunSpec, rank: int, world_size: int) -> None:
        from torch.distributed.fsdp import fully_shard

        super().__init__(spec, rank, world_size)  # builds the model, its reference copy, and an optimizer
        # One FSDP unit over the whole policy: its forward reaches into the blocks' submodules rather than
        # calling each block, so per-block units would never be unsharded.
        fully_shard(self.model)
        # The optimizer must hold the sharded parameters (fully_shard replaced them with DTensors).
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=spec.train.lr)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded weights on every rank (collective), as plain tensors."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}

    def rollout_policy(self) -> torch.nn.Module:
        """An unsharded copy of the current policy: the rollout engine runs on whole weights."""
        plain = build_policy(self.spec.model)
        plain.load_state_dict(self.full_state(), strict=True)
        return plain

    def model_state(self) -> dict[str, torch.Tensor]:
        """The sharded state dict (DTensors) the way FSDP trainers checkpoint it."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model)
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}

    def final_state(self) -> dict[str, torch.Tensor]:
        return self.full_state()

    def gradients(self, step: StepBatch) -> StepGrads:
        """Forward/backward with FSDP's reduce-scatter (the DP mean), then the global pre-clip norm."""
        self.model.zero_grad(set_to_none=True)
        routing = routing_control(self.spec.routing, step.batch, step.routed_experts)
        out = rank_forward_backward(self.model, step.batch, step.loss or self.spec.loss, routing)
        total = 0.0
        shard_norms: dict[str, float] = {}
        grads: list[torch.Tensor] = []
        for name, p in self.model.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
            shard_norms[name] = float(_local(p.grad).detach().float().norm())
            total += float(_full(p.grad).detach().double().pow(2).sum())  # same order as global_grad_norm
        fsdp_norm = float(_full(torch.nn.utils.get_total_norm(grads)))
        loss = float(out.loss.detach())
        (loss_sum,) = all_reduce_sum([loss])
        self._fsdp_norm = fsdp_norm
        return StepGrads(
            grad_norm=math.sqrt(total),
            local_param_norms=shard_norms,
            loss=loss,
            num_tokens=float(out.metrics["loss_tokens"]),
            global_loss=loss_sum / self.world_size,
        )

    def snapshot_payload(self, step: StepBatch, grads: StepGrads) -> RankPayload:
        payload = super().snapshot_payload(step, grads)
        # Under FSDP the unreduced local gradients never exist whole: each rank records the norms of its
        # shard of the reduced gradient, so the merged norm (sqrt of the sum of squares) is the reduced one.
        payload.grad_info["param_grad_norms_kind"] = "reduced_shard"
        payload.grad_info["fsdp_total_norm"] = getattr(self, "_fsdp_norm", float("nan"))
        payload.grad_info["parallel"] = "fsdp"
        return payload


def make_rank_trainer(spec: RunSpec, rank: int, world_size: int, strategy: str) -> RankTrainer:
    """The rank trainer for a parallel strategy (`ddp`: replicated weights, all-reduced gradients)."""
    if strategy == "fsdp":
        return FsdpRankTrainer(spec, rank, world_size)
    return RankTrainer(spec, rank, world_size)
