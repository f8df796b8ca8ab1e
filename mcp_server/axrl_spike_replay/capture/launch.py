"""Launch a function on every data-parallel rank: one process per rank (gloo over a FileStore), or in-process.

Each rank process runs with one intra-op thread so its reductions are deterministic.
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError

RankFn = Callable[[int, int, Any], None]


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
        torch.set_num_threads(1)
        try:
            fn(0, 1, payload)
        finally:
            torch.set_num_threads(threads)
        return

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="axrl-launch-") as tmp:
        store = Path(tmp) / "store"
        errors = Path(tmp)
        try:
            mp.spawn(_rank_entry, args=(fn, world_size, payload, str(store), str(errors), timeout_s), nprocs=world_size)
        except mp.ProcessRaisedException as exc:
            messages = sorted(errors.glob("axrl-error-rank*.txt"))
            if messages:
                raise AxrlError(messages[0].read_text(encoding="utf-8").strip()) from None
            raise AxrlError(f"a rank process failed:\n{exc}") from None
        except mp.ProcessExitedException as exc:
            raise AxrlError(f"a rank process died ({exc})") from None


def _rank_entry(
    rank: int, fn: RankFn, world_size: int, payload: Any, store_path: str, errors_dir: str, timeout_s: float
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, payload)
        dist.barrier()  # every rank leaves together, so none tears down gloo while a peer still talks
    except AxrlError as exc:
        Path(errors_dir, f"axrl-error-rank{rank}.txt").write_text(f"rank {rank}: {exc}", encoding="utf-8")
        raise
    except BaseException:
        Path(errors_dir, f"trace-rank{rank}.txt").write_text(traceback.format_exc(), encoding="utf-8")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
