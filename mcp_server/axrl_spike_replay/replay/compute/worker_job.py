"""What a replay process is given (`WorkerJob`, pickled into spawned processes) and what it hands back per config
(`ConfigOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.result import Footprint
from axrl_spike_replay.models.policy import ModelSpec
from axrl_spike_replay.replay.compute.clean_gradient import SpikeBar
from axrl_spike_replay.replay.compute.model_build import Placement
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.precision import PrecisionPolicy


@dataclass(frozen=True)
class WorkerJob:
    """Everything a replay process needs (pickled into spawned processes)."""

    replay_dir: str
    model: ModelSpec
    configs: tuple[AppliedConfig, ...]
    world_size: int  # saved DP world size: the reduction always divides by it
    assignment: tuple[tuple[int, ...], ...]
    device: str = "cpu"
    repeat: int = 1
    top: int = 10
    counts: GlobalCounts | None = None  # the step's recorded global counts (normalization global)
    spike_bar: SpikeBar | None = None  # the verdict's bar the clean gradient is cleaned under (None: no median)
    shard: bool = False  # FSDP2 over the replay's processes (`replay.compute.model_build`); False: each holds the
    # whole model
    precision: PrecisionPolicy | None = None  # the trainer's recorded policy (None: the model's own dtype)
    checkpoint_layers: bool = False  # decoder layers recompute their activations in the backward (the plan's choice)

    @property
    def placement(self) -> Placement:
        return Placement(shard=self.shard, precision=self.precision, checkpoint_layers=self.checkpoint_layers)


@dataclass
class ConfigOutcome:
    """One config's replayed gradients, as process 0 saw them after the reduction."""

    config_id: str
    grad_norms: list[float] = field(default_factory=list)  # one per repeat
    top_params: list[dict[str, Any]] = field(default_factory=list)
    rank_metrics: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    footprint: Footprint | None = None  # mitigated configs: loss tokens / samples masked or changed
    cosine_to_clean: float | None = None  # mitigated configs: cosine of the gradient with the clean gradient
    clean_gradient: dict[str, Any] | None = None  # how the clean gradient was made (the same for every config)
    # the baseline: its per-parameter norms, of the reduced gradient and of each saved rank's own gradient (what the
    # recorded ones are checked against; kept off the result file)
    param_grad_norms: dict[str, float] | None = None
    rank_param_grad_norms: dict[int, dict[str, float]] | None = None

    def __post_init__(self) -> None:
        if self.rank_param_grad_norms:  # read back from JSON (spawned processes): ranks are keys again
            self.rank_param_grad_norms = {int(rank): norms for rank, norms in self.rank_param_grad_norms.items()}
