"""Packed sequences are refused by name, naming the batch file and the field, rather than replayed as one long
sequence that attends across its parts; a left-padded batch's positions are not mistaken for packing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.rank_data import load_rank_batch


def _save(directory: Path, batch: dict) -> Path:
    directory.mkdir()
    torch.save(batch, directory / "batch_rank0.pt")
    return directory


def test_cu_seqlens_are_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    tokens = torch.arange(3, 13)[None]
    snap = _save(
        tmp_path / "s", {"tokens": tokens, "loss_mask": torch.ones(1, 10), "cu_seqlens": torch.tensor([0, 4, 10])}
    )
    with pytest.raises(SnapshotError, match=r"batch_rank0\.pt: field 'cu_seqlens': packed sequences"):
        load_rank_batch(snap, 0)


def test_positions_that_restart_within_a_row_are_packing(tmp_path: Path) -> None:
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    batch = {"tokens": torch.arange(3, 13)[None], "loss_mask": torch.ones(1, 10), "position_ids": positions}
    with pytest.raises(SnapshotError, match="'position_ids' restarts within a row"):
        load_rank_batch(_save(tmp_path / "s", batch), 0)


def test_left_padding_is_not_packing(tmp_path: Path) -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = {"tokens": torch.ones(2, 5, dtype=torch.long), "loss_mask": torch.ones(2, 5), "attention_mask": mask,
             "position_ids": positions}  # fmt: skip
    assert load_rank_batch(_save(tmp_path / "s", batch), 0)["position_ids"].tolist() == positions.tolist()
