"""The fault hook's parts: what a fault sees of a rank's step (`StepParts`), what a fault is (`Fault`), how the
faults of a stage are called, and the base of the built-in faults (`BuiltinFault`: acts during the burst, on its
ranks and samples). `faults` and `unrecorded_faults` build on it; `faults` documents the stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from axrl_spike_replay.capture.fault_injection.fault_params import ParamRule, check_params
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.training.loss_config import LossConfig

STAGES = (
    "prompts",
    "rollout",
    "rewards",
    "advantages",
    "batch",
    "gradients",
    "stored",
)  # the last two: unrecorded_faults


@dataclass
class StepParts:
    """One rank's step as a fault sees it at `stage` (see the module doc for what `batch` holds at each stage)."""

    stage: str
    iteration: int
    rank: int
    world_size: int
    in_burst: bool
    prompt_len: int
    batch: dict[str, torch.Tensor]
    routed_experts: torch.Tensor | None = None  # from `rollout` on
    previous: dict[str, torch.Tensor] | None = None  # this rank's batch of the previous step, as the loss consumed it
    generator: torch.Generator | None = None  # the step's seeded stream: a fault that draws stays reproducible
    # the rank's `trainer_step.RankTrainer` (its policy and reference; typed loosely: that module imports this one)
    trainer: Any = field(default=None, repr=False)
    loss: LossConfig | None = None  # the loss settings this rank's step computes with (the run's, unless a fault)

    def response(self) -> torch.Tensor:
        """[B, T] bool: the response positions (after the prompt)."""
        where = torch.zeros_like(self.batch["tokens"], dtype=torch.bool)
        where[:, self.prompt_len :] = True
        return where

    def reward_groups(self) -> tuple[torch.Tensor, bool]:
        """[G, group] float: the rewards by GRPO group; and whether the run's group std is the unbiased one (verl's
        convention)."""
        assert self.trainer is not None
        unbiased = self.loss is not None and self.loss.convention == "verl"
        return self.batch["rewards"].float().view(-1, int(self.trainer.train.group_size)), unbiased

    def routing(self) -> Any:
        """The routing control the rank's trainer runs this batch with (its routing mode, the batch's routes)."""
        from axrl_spike_replay.training.routing_replay import routing_control

        assert self.trainer is not None
        return routing_control(self.trainer.spec.routing, self.batch, self.routed_experts)


class Fault(Protocol):
    """A trainer bug: called after each `stage` of every step with the step's parts; corrupts `part` in place."""

    @property
    def stage(self) -> str: ...

    @property
    def part(self) -> str: ...

    def __call__(self, parts: StepParts) -> None: ...


def apply_faults(faults: Sequence[Fault], parts: StepParts) -> None:
    """Call every fault of `parts.stage` on `parts` (in the order given); a fault with `stages` acts at each."""
    for fault in faults:
        if parts.stage in getattr(fault, "stages", (fault.stage,)):
            fault(parts)


# --- the built-in faults -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltinFault:
    """A built-in fault: it acts during the burst on its ranks (None: every rank), on its samples (None: all)."""

    spec: FaultSpec

    stage = "batch"
    part = "batch"
    PARAMS: ClassVar[dict[str, ParamRule]] = {}  # the parameters it takes, each with its rule

    def __call__(self, parts: StepParts) -> None:
        if parts.in_burst and self.hits(parts.rank, parts.world_size):
            self.corrupt(parts)

    def hits(self, rank: int, world_size: int) -> bool:
        """Whether this fault acts on `rank` (a negative rank counts from the last one)."""
        if self.spec.ranks is None:
            return True
        return any(r % world_size == rank for r in self.spec.ranks)

    def rows(self, batch_size: int) -> list[int]:
        """The samples (rows of this rank's batch) it corrupts."""
        if self.spec.samples is None:
            return list(range(batch_size))
        return sorted({s % batch_size for s in self.spec.samples})

    def replace_rows(self, parts: StepParts, name: str, values: torch.Tensor) -> None:
        """`parts.batch[name]`'s hit rows replaced by `values`' (in its dtype), in a new tensor."""
        out = parts.batch[name].clone()
        rows = self.rows(out.shape[0])
        out[rows] = values[rows].to(out.dtype)
        parts.batch[name] = out

    def param(self, name: str, default: Any) -> Any:
        return self.spec.params.get(name, default)

    @classmethod
    def check_spec(cls, spec: FaultSpec) -> None:
        """ConfigError naming the first parameter of `spec` this fault does not take, or whose value is wrong."""
        check_params(spec.kind, spec.params, cls.PARAMS)

    def corrupt(self, parts: StepParts) -> None:
        raise NotImplementedError
