"""Launch a function on every data-parallel rank of the reference trainer: spawned processes, or in-process."""

from __future__ import annotations

from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.processes.rank_processes import RankFn, spawn_ranks


def launch(fn: RankFn, world_size: int, payload: Any, *, timeout_s: float = 600.0) -> None:
    """Run `fn(rank, world_size, payload)` on every rank; world size 1 runs in this process.

    `fn` must be a module-level function (it is pickled into spawned processes). An AxrlError in
    any rank is raised here with the rank's message; other failures raise with the rank's traceback.
    """
    import torch

    if world_size < 1:
        raise AxrlError(f"world size must be >= 1, got {world_size}")
    if world_size == 1:
        threads = torch.get_num_threads()
        deterministic = torch.are_deterministic_algorithms_enabled()  # a transformers model pins it while it trains
        torch.set_num_threads(1)
        try:
            fn(0, 1, payload)
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
        return

    spawn_ranks(fn, world_size, payload, timeout_s=timeout_s)
