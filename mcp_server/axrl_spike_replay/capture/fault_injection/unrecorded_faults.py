"""Trainer bugs the snapshot cannot show: the rank's step is computed from inputs the snapshot holds exactly, but the
trainer does something to it that its run config does not record (a scale on the gradients or the loss), or it
stores another batch than the one it trained on. A replay of such a snapshot does not reproduce the recorded step;
what the replay's per-rank comparison shows (which ranks, one factor or a pattern by layer or parameter family) is
the evidence.

Two stages beyond the five of `capture.fault_injection.faults` serve them:

- `gradients`: after the rank's backward, before its local norms are measured and the gradients reduced:
  `parts.trainer.model`'s `.grad` are the rank's own gradients (a fault scales them in place);
- `stored`: when the spike guard writes the snapshot: `parts.batch` is the rank's batch as it will be stored
  (a copy; the step already ran on the real one) and `parts.routed_experts` its routing payload; `parts.previous`
  the batch of its previous step, its routes under `_routed_experts`.

The FSDP trainer reduces gradients inside its backward, so the `gradients` stage is the DDP trainer's alone; an FSDP
capture with such a fault is refused before it trains.

A fault may act at more than one stage (`stages`): `StoredAdvantagesBeforeScale` scales the advantages the loss
uses and stores the ones before. Each fault here is a bug a real stack has had; none is a kind any preset uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import MAX_SCALE, ParamRule, layer_list, number, one_of
from axrl_spike_replay.models.param_groups import family_of, layer_of

FACTOR = {"factor": number(1e-6, MAX_SCALE)}
SCALED_FAMILIES = ("experts", "router", "attention", "embedding", "head", "norm")


def _scale_grads(parts: StepParts, factor: float, keep: Any) -> None:
    """Multiply the rank's own gradients of the parameters `keep(name)` selects by `factor`, in place."""
    assert parts.trainer is not None
    with torch.no_grad():
        for name, p in parts.trainer.model.named_parameters():
            if p.grad is not None and keep(name):
                p.grad.mul_(factor)


class GradScale(BuiltinFault):
    """A rank that accumulates its micro-batches' gradients without dividing by their count (its gradient
    accumulation setting is not the run's): every gradient of the rank is `factor` times what its loss gives."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = FACTOR

    def corrupt(self, parts: StepParts) -> None:
        _scale_grads(parts, float(self.param("factor", 8.0)), lambda _name: True)


class LayerGradScale(BuiltinFault):
    """A rank whose gradients of some decoder layers are scaled: a gradient hook registered twice on those layers'
    modules (a wrapper applied on top of another), or an fp16 unscale skipped for one parameter group."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {**FACTOR, "layers": layer_list}

    def corrupt(self, parts: StepParts) -> None:
        layers = set(self.param("layers", None) or [0])
        _scale_grads(parts, float(self.param("factor", 8.0)), lambda name: layer_of(name) in layers)


class FamilyGradSum(BuiltinFault):
    """A rank whose gradients of one parameter family are summed where they should be averaged (the routed
    experts' gradients all-reduced with SUM over the expert-parallel group, a router's over the sequence-parallel
    group): that family's gradients are `factor` times the loss's."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {**FACTOR, "family": one_of(*SCALED_FAMILIES)}

    def corrupt(self, parts: StepParts) -> None:
        family = str(self.param("family", "experts"))
        _scale_grads(parts, float(self.param("factor", 4.0)), lambda name: family_of(name) == family)


class LossSumNotMean(BuiltinFault):
    """A rank that sums its micro-batches' losses where the run averages them (a rank-dependent code path in the
    trainer's loss aggregation): its whole loss, and so its gradient, is `factor` (its micro-batch count) times the
    run's, and it records that loss."""

    stage = "batch"
    part = "loss"
    PARAMS: ClassVar[dict[str, ParamRule]] = FACTOR

    def corrupt(self, parts: StepParts) -> None:
        if parts.loss is not None:
            parts.loss = dataclasses.replace(parts.loss, loss_scale=float(self.param("factor", 8.0)))


class StoredAdvantagesBeforeScale(BuiltinFault):
    """A rank that rescales its advantages in place after the snapshot writer took its copy of the batch (a
    per-rank whitening by a standard deviation computed on the rank alone, tiny when its groups' rewards are near
    equal): the loss uses the advantages times `factor`, the snapshot stores those before."""

    stage = "advantages"
    stages: ClassVar[tuple[str, ...]] = ("advantages", "stored")
    part = "advantages"
    PARAMS: ClassVar[dict[str, ParamRule]] = FACTOR

    def corrupt(self, parts: StepParts) -> None:
        factor = float(self.param("factor", 16.0))
        advantages = parts.batch["advantages"]
        if parts.stage == "stored":
            parts.batch["advantages"] = advantages / factor
        else:
            parts.batch["advantages"] = advantages * factor


class StoredBatchPrevious(BuiltinFault):
    """A rank whose snapshot stores its previous step's batch (the writer reads a batch buffer the data loader's
    prefetch has not refilled, or one keyed by a stale index): the stored batch is not the one it trained on."""

    stage = "stored"
    part = "batch"

    def corrupt(self, parts: StepParts) -> None:
        if parts.previous is None:
            return
        for name, value in parts.previous.items():
            if name == "_routed_experts" and parts.routed_experts is not None:
                if value.shape == parts.routed_experts.shape:
                    parts.routed_experts = value.clone()  # the routing payload of the same stale step
            elif name in parts.batch and parts.batch[name].shape == value.shape:
                parts.batch[name] = value.clone()


UNRECORDED_KINDS: dict[str, type[BuiltinFault]] = {
    "grad_scale": GradScale,
    "layer_grad_scale": LayerGradScale,
    "family_grad_sum": FamilyGradSum,
    "loss_sum_not_mean": LossSumNotMean,
    "stored_advantages_before_scale": StoredAdvantagesBeforeScale,
    "stored_batch_previous": StoredBatchPrevious,
}
