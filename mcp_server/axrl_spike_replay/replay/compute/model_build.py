"""The policy a replay process computes with: whole, or sharded with FSDP2 over the replay's processes, in the
trainer's precision.

Either way the process first gives freed host memory back to the system (`replay.compute.host_allocator`).

Whole: built on the CPU, every weight loaded, then (a recorded precision policy) cast as FSDP would
(`training.precision.cast_for_compute`) and moved to the device.

Sharded: built on the meta device (no memory), each decoder layer made an FSDP unit with `fully_shard` and the root
last, with the trainer's `MixedPrecisionPolicy` and no backward prefetch (one unit gathered at a time); then each
process gets memory for its own shards only (`to_empty`) and reads their rows from the weights
(`models.sharded_weights`). No process ever holds the whole model. The units' reduce-scatter sums (no division,
`gradient_divide_factor` 1): the replay divides by the saved data-parallel world size itself, as
`training.rank_step.reduce_grads` does. Every process of the default process group takes part, whoever started them (our
spawn launcher, a warm pool, torchrun).

With a recorded precision policy the parameters are held in float32, the trainer's master weights, whatever
dtype the model section names (verl records its compute dtype there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.policy import (
    ModelSpec,
    build_policy,
    load_policy_shards,
    load_policy_weights,
    restore_buffers,
    shard_units,
)
from axrl_spike_replay.replay.compute.host_allocator import return_freed_host_memory
from axrl_spike_replay.training.precision import PrecisionPolicy, cast_for_compute

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Placement:
    """How a replay process holds the policy: sharded or whole, and the precision it computes in (None: the
    model's own dtype throughout, as replays ran before precision was recorded)."""

    shard: bool = False
    precision: PrecisionPolicy | None = None
    checkpoint_layers: bool = False  # each decoder layer recomputed in the backward (`models.layer_checkpoint`)


def master_spec(spec: ModelSpec, precision: PrecisionPolicy | None) -> ModelSpec:
    """The spec whose parameters hold the weights: float32 master weights under a recorded precision policy."""
    if precision is None or not precision.recorded:
        return spec
    if isinstance(spec, MegatronModelConfig):
        return dataclasses.replace(spec, hf=dataclasses.replace(spec.hf, dtype="float32"))
    if isinstance(spec, HFModelConfig) and spec.dtype != "float32":
        return dataclasses.replace(spec, dtype="float32")
    return spec


def build_model(spec: ModelSpec, weights_dir: str, device: str, placement: Placement | None = None) -> nn.Module:
    """The policy with weights from a DCP checkpoint dir (a snapshot or another checkpoint), or for an HF model
    an HF directory or verl shards (the weights dir itself, or the spec's `path` when the snapshot holds no
    checkpoint), or a Megatron checkpoint; whole or sharded as `placement` says."""
    placement = placement or Placement()
    check_kernels_run(spec, device)
    return_freed_host_memory()
    if placement.shard:
        model = build_sharded(spec, weights_dir, device, placement.precision)
    else:
        model = build_policy(master_spec(spec, placement.precision), "cpu")
        load_policy_weights(model, spec, weights_dir)
        if placement.precision is not None and placement.precision.recorded:
            cast_for_compute(model, shard_units(model), placement.precision)
        model = model.to(device)
    if placement.checkpoint_layers:
        from axrl_spike_replay.models.layer_checkpoint import checkpoint_layers

        checkpoint_layers(model)
    return model


def check_kernels_run(spec: ModelSpec, device: str) -> None:
    """ConfigError, before anything loads, when the spec's attention kernel cannot run on `device` here
    (`models.attention_kernels`)."""
    from axrl_spike_replay.models.attention_kernels import check_attention_runs

    if isinstance(spec, HFModelConfig):
        check_attention_runs(spec.attn_implementation, spec.dtype, device)


def _mesh_device(device: str) -> str:
    return device.split(":")[0]


def build_sharded(spec: ModelSpec, weights_dir: str, device: str, precision: PrecisionPolicy | None) -> nn.Module:
    """The policy sharded over every process of the default process group (a collective: all build it together)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("a sharded replay runs in a process group (started by the replay launcher or torchrun)")
    built = master_spec(spec, precision)
    model = build_policy(built, "meta")
    mesh = init_device_mesh(_mesh_device(device), (dist.get_world_size(),))
    policy = (precision or PrecisionPolicy.of_model("float32")).fsdp_policy()
    units = shard_units(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
        # no backward prefetch: a unit's only prefetch target is itself, already gathered (FSDP2 otherwise gathers
        # the next unit during this one's backward, one unit more at the step's peak, for an overlap a one-step
        # replay does not need)
        cast(FSDPModule, unit).set_modules_to_backward_prefetch([cast(FSDPModule, unit)])
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=torch.device(device))
    restore_buffers(model)
    load_policy_shards(model, spec, weights_dir)
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ConfigError(f"sharded build left {len(left)} tensors without memory ({', '.join(left[:4])})")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: the replay divides by the saved world size
            module.set_force_sum_reduction_for_comms(True)
            module.set_reduce_scatter_unused_params(True, recurse=False)  # every unit reduces on every process
    return model
