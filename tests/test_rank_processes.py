"""The process-per-rank launcher that the trainer and the replay share: real gloo groups on this machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.rank_processes import RankProcessError, spawn_ranks


def _all_reduce_ranks(rank: int, nproc: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    Path(out, f"rank{rank}.txt").write_text(f"{value.item():g}")


def _abort_once(rank: int, nproc: int, out: str) -> None:
    marker = Path(out, "aborted-once")
    if rank == 1 and not marker.exists():
        marker.touch()
        os.abort()  # a native crash: no Python traceback, no report file
    Path(out, f"rank{rank}.txt").write_text("done")


def _refuse(rank: int, nproc: int, out: str) -> None:
    raise AxrlError(f"rank {rank} found nothing to do in {out}")


def test_every_rank_joins_one_process_group(tmp_path: Path) -> None:
    spawn_ranks(_all_reduce_ranks, 3, str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.glob("rank*.txt")) == ["6", "6", "6"]


def test_a_native_crash_is_reported_with_its_signal(tmp_path: Path) -> None:
    with pytest.raises(RankProcessError, match="SIGABRT"):
        spawn_ranks(_abort_once, 2, str(tmp_path))


def test_side_effect_free_work_survives_one_native_crash(tmp_path: Path) -> None:
    spawn_ranks(_abort_once, 2, str(tmp_path), native_crash_retries=1)
    assert (tmp_path / "aborted-once").exists()
    assert sorted(p.name for p in tmp_path.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]


def test_expected_errors_come_back_with_the_rank_s_message_and_are_not_retried(tmp_path: Path) -> None:
    with pytest.raises(AxrlError, match="found nothing to do"):
        spawn_ranks(_refuse, 2, str(tmp_path), native_crash_retries=3)
