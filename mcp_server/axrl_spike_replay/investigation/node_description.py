"""A node described by its GPUs (`plan --gpus N --gpu-memory GIB`, MCP `plan_replay`): the bounds both faces hold
it to, torch-free so the MCP tool's schema states them without loading the planner."""

from __future__ import annotations

from axrl_spike_replay.errors import ConfigError

MAX_GPUS = 4096  # GPUs of one node: far above any machine built, far below what overflows the plan's arithmetic
MAX_GPU_MEMORY_GIB = 65536.0  # one GPU's memory, likewise


def check_described_node(gpus: int, gpu_memory_gib: float) -> None:
    """ConfigError unless `gpus` is a whole number from 1 to MAX_GPUS and `gpu_memory_gib` a finite number of GiB
    above 0 and at most MAX_GPU_MEMORY_GIB (inf, NaN or 1e300 would overflow the byte counts)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS:
        raise ConfigError(f"`gpus` must be a whole number from 1 to {MAX_GPUS}, got {_said(gpus)}", "gpus")
    if not isinstance(gpu_memory_gib, (int, float)) or not 0 < gpu_memory_gib <= MAX_GPU_MEMORY_GIB:
        raise ConfigError(
            f"`gpu_memory_gib` must be a number of GiB above 0 and at most {MAX_GPU_MEMORY_GIB:g}, "
            f"got {_said(gpu_memory_gib)}",
            "gpu_memory_gib",
        )


def _said(value: object) -> str:
    """A bad value as a message shows it: an integer too long to print whole is said by its length."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value))) if value.bit_length() < 14000 else 'over 4000'} digits"
    return f"{value!r:.60}"
