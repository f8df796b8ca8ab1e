"""A library that widens torch's weights_only allowlist for its whole process (megatron-core registers PosixPath,
SimpleNamespace, numpy arrays, BytesIO, ... when imported) does not widen what a snapshot file may hold."""

from __future__ import annotations

from pathlib import Path, PosixPath

import pytest
import torch

from axrl_spike_replay.errors import UnsafeFileError
from axrl_spike_replay.snapshot.safe_load import load_pt


def test_process_wide_safe_globals_do_not_reach_snapshot_files(tmp_path: Path) -> None:
    path = tmp_path / "grad_info_rank0.pt"
    torch.save({"grad_norm": 1.0, "where": PosixPath("/x")}, path)
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([PosixPath])  # as `import megatron.core` does
    try:
        assert torch.load(path, weights_only=True)["where"] == PosixPath("/x")  # torch itself now admits it
        with pytest.raises(UnsafeFileError, match="PosixPath"):
            load_pt(path)
        assert PosixPath in torch.serialization.get_safe_globals()  # the process's own list is given back
        assert load_pt(path, allowed_globals=[PosixPath])["where"] == PosixPath("/x")
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
