"""The transformers-model tests share one recorded snapshot of the tiny qwen3_moe (saved world size 2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared_capture import left_as_recorded


@pytest.fixture(scope="session")
def hf_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A spike snapshot of the tiny qwen3_moe recorded with the trainer's own rank step (world size 2).

    Shared by the session: read it, or copy it before editing anything in it.
    """
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    root = tmp_path_factory.mktemp("hf-qwen3-moe")
    snapshot = record_hf_snapshot(root, "qwen3_moe", world_size=2)
    check = left_as_recorded(root)
    yield snapshot
    check()
