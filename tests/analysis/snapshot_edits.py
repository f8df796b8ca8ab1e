"""Hand edits of a copy of the golden snapshot, for the diagnosis tests (shared helper, not a test)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"


def copy_fixture(tmp_path: Path) -> Path:
    """A copy of the golden job output dir (with its log) under `tmp_path`; its spike snapshot (iteration 21)."""
    out = tmp_path / FIXTURE.name
    shutil.copytree(FIXTURE, out)
    return out / "checkpoints" / "spike_snapshots" / "iter_0000021"


def edit_batch(snapshot: Path, rank: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Load rank `rank`'s batch, apply `edit` to it in place, save it back."""
    path = snapshot / f"batch_rank{rank}.pt"
    batch = torch.load(path, weights_only=True)
    edit(batch)
    torch.save(batch, path)


def edit_grad_info(snapshot: Path, rank: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Load rank `rank`'s grad info, apply `edit` to it in place, save it back."""
    path = snapshot / f"grad_info_rank{rank}.pt"
    info = torch.load(path, weights_only=True)
    edit(info)
    torch.save(info, path)


def no_mismatch(snapshot: Path) -> None:
    """Rollout logprobs made the trainer's on every rank: the fixture's log-prob mismatch is gone."""
    for rank in (0, 1):
        edit_batch(snapshot, rank, lambda b: b.__setitem__("rollout_logprobs", b["old_logprobs"].clone()))
