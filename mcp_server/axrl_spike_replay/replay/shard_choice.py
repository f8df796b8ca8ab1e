"""Whether a replay shards the policy: `shard: on | off | auto`, auto deciding by `fits_one_process`.

`fits_one_process` is a bytes estimate: the parameters and one gradient in the precision that runs, against the
memory one process of this machine can have (CPU: available RAM shared by the replay's processes; CUDA: a GPU's
free memory, shared when there are fewer GPUs than processes). It leaves out activations and the snapshot's
batches, so it says "fits" generously; a replay plan that predicts activations too can replace it (same
arguments, same answer type).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.policy import ModelSpec, parameter_count
from axrl_spike_replay.training.precision import PrecisionPolicy
from axrl_spike_replay.vocabulary import Shard

if TYPE_CHECKING:
    from axrl_spike_replay.replay.inputs import ReplayInputs

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ShardChoice:
    """Whether to shard, and why (said in the replay's log)."""

    shard: bool
    reason: str


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
    """This machine's available memory (`MemAvailable` of /proc/meminfo; the physical memory where that cannot be
    read)."""
    import os

    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def fits_one_process(spec: ModelSpec, precision: PrecisionPolicy, device: str, processes: int) -> bool:
    """Whether the whole model fits each of `processes` replay processes on `device` (see the module docstring)."""
    return bytes_whole(spec, precision) <= available_bytes(device, processes)


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
    """For work that, whole, runs in this one process (attribution, diagnose's model evidence): auto shards when the
    whole model does not fit one process here, over `processes` processes (one cannot shard); on and off as said."""
    spec, precision = inputs.model, inputs.effective_precision
    if Shard.parse(mode, "`shard`") != Shard.AUTO:
        return choose_shard(mode, spec, precision, device, processes)
    if fits_one_process(spec, precision, device, 1):
        return ShardChoice(False, "shard auto: the whole model fits this process")
    if processes == 1:
        return ShardChoice(False, "shard auto: the whole model does not fit one process, and one process cannot shard")
    return choose_shard(Shard.ON, spec, precision, device, processes)


def planned_shard(snapshot: str, processes: int, device: str, configs: int) -> bool | None:
    """Whether the replay plan (`replay.replay_plan`, activations and batches counted) shards `processes` processes
    under `shard: auto`; None when the plan cannot read the snapshot (the engine names what is wrong)."""
    from axrl_spike_replay.replay.replay_plan import plan_replay

    try:
        chosen = plan_replay(snapshot, nproc=processes, device=device, shard="auto", configs=configs).chosen
    except Exception:  # a snapshot the plan cannot read: the engine's own checks say why
        return None
    return None if chosen is None else chosen.sharded


def choose_shard(
    mode: str,
    spec: ModelSpec,
    precision: PrecisionPolicy,
    device: str,
    processes: int,
    planned: bool | None = None,
) -> ShardChoice:
    """Sharded or whole for `mode` (on, off, auto); ConfigError when sharding cannot run on this device. Under auto,
    `planned` (the replay plan's choice, when known) shards too when the plan's fuller memory model says so."""
    mode = Shard.parse(mode, "`shard`") if not isinstance(mode, Shard) else mode
    if mode == Shard.OFF:
        return ShardChoice(False, "shard off: every process holds the whole model")
    if mode == Shard.ON:
        _check_device(device, processes)
        return ShardChoice(True, f"shard on: FSDP2 over {processes} process(es)")
    need = bytes_whole(spec, precision)
    have = available_bytes(device, processes)
    if planned and processes > 1:
        _check_device(device, processes)
        return ShardChoice(
            True, f"shard auto: the replay plan says the whole model does not fit: FSDP2 over {processes}"
        )
    if need <= have:
        return ShardChoice(False, f"shard auto: the whole model ({_gib(need)}) fits one process ({_gib(have)} each)")
    if processes == 1:
        return ShardChoice(
            False,
            f"shard auto: the whole model ({_gib(need)}) does not fit one process ({_gib(have)}), and one process "
            "gains nothing from sharding; replay on more processes (`nproc`) to shard",
        )
    _check_device(device, processes)
    return ShardChoice(
        True,
        f"shard auto: the whole model ({_gib(need)}) does not fit one process ({_gib(have)}): FSDP2 over {processes}",
    )


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
