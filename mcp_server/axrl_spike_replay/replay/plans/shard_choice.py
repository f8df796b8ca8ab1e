"""Whether a replay shards the policy: `shard: on | off | auto`, auto deciding from the replay plan.

Under auto the replay plan (`replay.plans.replay_plan`: parameters, gradients, activations, runtime and loading per
process, in the layout that will run) is made against the memory where the processes run (this machine's by
default, or a capacity the caller knows: a probed node's GPUs). Its choice is the replay's: whole while the
whole-model row fits, sharded (FSDP2) otherwise; one process stays whole (sharding it gains nothing). The reason
says the plan's figures, and is logged and kept in the result.

Attribution and diagnose's model evidence, which whole run in the calling process, choose by `whole_or_sharded`:
under auto a bytes estimate of the model and one gradient against this process's memory (their per-sample passes
are not what the replay plan models). `check_whole_fits` refuses, with the same estimate and before anything loads,
such work asked to run whole when it does not fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.policy import ModelSpec, parameter_count
from axrl_spike_replay.training.precision import PrecisionPolicy
from axrl_spike_replay.vocabulary import Shard

if TYPE_CHECKING:
    from axrl_spike_replay.replay.plans.replay_plan import Capacity, PlanRow, ReplayPlan
    from axrl_spike_replay.replay.reading.inputs import ReplayInputs

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STREAMED_REASON = (
    "shard streamed: every saved rank in this process, one decoder layer at a time read from the checkpoint "
    "(read twice: forward and backward)"
)


@dataclass(frozen=True)
class ShardChoice:
    """Whether to shard, and why (said in the replay's log)."""

    shard: bool
    reason: str
    checkpoint: bool = False  # decoder layers checkpointed (`models.layer_checkpoint`), as the plan's row says
    streamed: bool = False  # one decoder layer at a time, every saved rank in one process (`replay.streamed`)
    read_ahead: bool = True  # streamed: the next layer read during the current one's compute, where the plan fits it
    experts: bool = False  # streamed over processes: each MoE layer's routed experts split, as the plan's row chose


def bytes_whole(spec: ModelSpec, precision: PrecisionPolicy) -> int:
    """Bytes one process holds for the whole model: parameters in the compute dtype and one gradient, reduced in
    `reduce_dtype` (the gradients of a replay's configs are measured one at a time)."""
    return parameter_count(spec) * (_BYTES[precision.param_dtype] + _BYTES[precision.reduce_dtype])


def available_bytes(device: str, processes: int) -> int:
    """Memory one of `processes` replay processes on this machine can use."""
    if device.startswith("cuda"):
        import torch

        gpus = max(torch.cuda.device_count(), 1)
        free, _ = torch.cuda.mem_get_info(0)
        return int(free * min(gpus, processes) / processes)
    return available_memory_bytes() // max(processes, 1)


def available_memory_bytes() -> int:
    """This machine's available memory (the replay plan's reading of it)."""
    from axrl_spike_replay.replay.plans.replay_plan import available_memory

    return available_memory()


def check_whole_fits(spec: ModelSpec, precision: PrecisionPolicy, device: str, what: str) -> None:
    """Refuse, by name and before anything loads, work asked to hold the whole model in one process (an
    attribution or diagnose's model evidence, unsharded) when the model does not fit one process here."""
    need, have = bytes_whole(spec, precision), available_bytes(device, 1)
    if need > have:
        raise ConfigError(
            f"{what} with the whole model in one process does not fit: the model and one gradient take "
            f"{_gib(need)}, one process here has {_gib(have)}; run it sharded (`shard` on, `nproc` > 1)"
        )


def whole_or_sharded(mode: str, inputs: ReplayInputs, device: str, processes: int) -> ShardChoice:
    """For work that, whole, runs in this one process (attribution, diagnose's model evidence): auto shards over
    `processes` processes when the whole model and a gradient do not fit this process (one cannot shard); on and
    off as said."""
    parsed = Shard.parse(mode, "`shard`")
    if parsed == Shard.STREAMED:
        raise ConfigError(
            "`shard` streamed: this work runs whole or sharded (attribution and the signal check stream by their own "
            "entries); use on or off",
            "shard",
        )
    if parsed != Shard.AUTO:
        return choose_shard(mode, device, processes)
    need, have = bytes_whole(inputs.model, inputs.effective_precision), available_bytes(device, 1)
    if need <= have:
        return ShardChoice(False, f"shard auto: the whole model and a gradient ({_gib(need)}) fit this process")
    if processes == 1:
        return ShardChoice(
            False, f"shard auto: the whole model and a gradient ({_gib(need)}) do not fit, and one process cannot shard"
        )
    _check_device(device, processes)
    return ShardChoice(
        True,
        f"shard auto: the whole model and a gradient ({_gib(need)}) do not fit this process ({_gib(have)}): "
        f"FSDP2 over {processes}",
    )


def planned_shard(
    snapshot: str,
    nproc: int | None,
    device: str,
    configs: int,
    capacity: Capacity | str | None = "here",
    nodes: int = 1,
    shard: str = "auto",
) -> ReplayPlan | None:
    """The replay plan under `shard` (auto: whole while it fits) of a replay asked for `nproc` processes over `nodes`
    nodes, against `capacity` ("here": this machine's memory; None: unknown, so the whole model stays, not
    checkpointed); None when the plan cannot read the snapshot (the engine names what is wrong). Its rows are those
    the replay would run: whole or sharded over `nproc` (default one per saved rank), and the streamed row over
    `nproc` (default one: a streamed replay splits the saved ranks only when asked), its split as it chooses."""
    from axrl_spike_replay.replay.plans.replay_plan import plan_replay

    try:
        return plan_replay(
            snapshot,
            nproc=(nproc or 1) if shard == "streamed" else nproc,
            device=device,
            capacity=capacity,
            shard=str(shard),
            configs=configs,
            nodes=nodes,
        )
    except Exception:  # a snapshot the plan cannot read: the engine's own checks say why
        return None


def with_checkpoint(choice: ShardChoice, plan: ReplayPlan | None, requested: bool | None = None) -> ShardChoice:
    """`choice` with its decoder layers checkpointed as `requested` (True / False), or, None, as the replay plan's
    row for this layout says (the plan checkpoints when the layout does not fit without it); the reason says so."""
    if requested is None:
        row = plan.chosen if plan is not None else None
        planned = row is not None and row.sharded == choice.shard and row.checkpointed
        if choice.checkpoint or not planned:
            return choice
        return dataclasses.replace(choice, reason=choice.reason + _CHECKPOINTED, checkpoint=True)
    if requested == choice.checkpoint or choice.streamed:  # a streamed replay recomputes each layer anyway
        return choice
    said = "checkpointed" if requested else "not checkpointed"
    reason = choice.reason.replace(_CHECKPOINTED, "") + f", decoder layers {said} (as requested)"
    return dataclasses.replace(choice, reason=reason, checkpoint=requested)


def whole_or_sharded_planned(
    mode: str, inputs: ReplayInputs, device: str, processes: int, checkpoint: bool | None = None
) -> ShardChoice:
    """`whole_or_sharded`, with decoder layers checkpointed as `checkpoint` says, or (None) as the replay plan of
    that layout says: the whole model in one process holding every saved rank, or sharded over `processes`."""
    choice = whole_or_sharded(mode, inputs, device, processes)
    if checkpoint is not None:
        return with_checkpoint(choice, None, checkpoint)
    plan = planned_shard(
        inputs.replay_dir, processes if choice.shard else 1, device, 1, shard="on" if choice.shard else "off"
    )
    return with_checkpoint(choice, plan)


def choose_shard(mode: str, device: str, processes: int, plan: ReplayPlan | None = None) -> ShardChoice:
    """Sharded or whole for `mode` (on, off, auto); ConfigError when sharding cannot run on this device. Under
    auto, `plan` (the replay plan made with `shard: auto` for these processes) decides; under on and off, `plan`
    (made with that `shard`) says whether the decoder layers are checkpointed."""
    mode = Shard.parse(mode, "`shard`") if not isinstance(mode, Shard) else mode
    if mode == Shard.OFF:
        return with_checkpoint(ShardChoice(False, "shard off: every process holds the whole model"), plan)
    if mode == Shard.STREAMED:
        ahead = plan is None or plan.streamed is None or plan.streamed.read_ahead
        experts = _experts_split(plan)
        return ShardChoice(False, STREAMED_REASON + experts, streamed=True, read_ahead=ahead, experts=bool(experts))
    if mode == Shard.ON:
        _check_device(device, processes)
        return with_checkpoint(ShardChoice(True, f"shard on: FSDP2 over {processes} process(es)"), plan)
    row = plan.chosen if plan is not None else None
    if plan is None or row is None:
        return ShardChoice(False, "shard auto: no replay plan could be made for this snapshot: whole model")
    if plan.streams and plan.streamed is not None:
        return ShardChoice(
            False,
            "shard auto: no layout holding the whole step fits at full fidelity; streamed, "
            f"{_gib(plan.streamed.device_peak)} on the device: "
            + STREAMED_REASON.removeprefix("shard streamed: ")
            + _experts_split(plan),
            streamed=True,
            read_ahead=plan.streamed.read_ahead,
            experts=bool(_experts_split(plan)),
        )
    cap = plan.capacity
    where = "capacity unknown" if cap is None else f"{_gib(cap.bytes_each)} usable on {cap.where}"
    if not row.sharded:
        said = {True: "fits", False: "does not fit", None: "cannot be judged"}[row.fits]
        reason = (
            f"shard auto: the replay plan's whole-model peak, {_gib(row.memory.peak)} per process "
            f"({row.processes_per_device} per device: {_gib(row.per_device)}), {said} ({where})"
        )
        if row.fits is False and processes == 1:
            reason += "; one process gains nothing from sharding: replay on more processes (`nproc`) to shard"
        return ShardChoice(False, reason + ": whole model in each process" + _checkpointed(row), row.checkpointed)
    _check_device(device, processes)
    unsharded = plan.whole or row
    return ShardChoice(
        True,
        f"shard auto: the replay plan's whole-model peak, {_gib(unsharded.memory.peak)} per process "
        f"({unsharded.processes_per_device} per device: {_gib(unsharded.per_device)}), does not fit ({where}): "
        f"FSDP2 over {processes}, {_gib(row.memory.peak)} per process"
        + ("" if row.fits else " (over the memory too: the plan's refusal applies where it is checked)")
        + _checkpointed(row),
        row.checkpointed,
    )


def _experts_split(plan: ReplayPlan | None) -> str:
    """Where the plan's streamed row split each MoE layer's routed experts over its processes, the reason's words."""
    row = None if plan is None else plan.streamed
    if row is None or row.split != "experts":
        return ""
    return (
        f"; each MoE layer's routed experts split over the {row.processes} processes ({_gib(row.experts_peak)} per "
        f"process; split by saved ranks, {_gib(row.ranks_peak)}, does not fit)"
    )


_CHECKPOINTED = ", decoder layers checkpointed (their activations recomputed in the backward)"


def _checkpointed(row: PlanRow) -> str:
    return _CHECKPOINTED if row.checkpointed else ""


def _check_device(device: str, processes: int) -> None:
    if device.startswith("cuda"):
        import torch

        # where this machine has no CUDA the processes run on launched nodes (a local CUDA replay was refused before)
        if torch.cuda.is_available() and torch.cuda.device_count() < processes:
            raise ConfigError(
                f"`shard`: a sharded replay on CUDA needs a GPU per process (NCCL); {processes} processes, "
                f"{torch.cuda.device_count()} GPU(s) visible: use `nproc` {max(torch.cuda.device_count(), 1)} or fewer",
                "shard",
            )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
