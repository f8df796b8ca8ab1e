"""Megatron-core checkpoints and snapshots written by megatron-core's own code, once per test session.

Every test here needs megatron-core (installed by scripts/setup.sh without its CUDA extras); where it is not
installed, or is a release these routes were not checked against, they skip and say why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_helpers import REASON


@pytest.fixture(scope="session")
def megatron_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{layout: checkpoint dir} of the tiny Qwen3-MoE GPTModel saved by `dist_checkpointing.save` at TP=1 (one
    process), TP=2 (with ETP=2), EP=2 and PP=2 (two processes each): the same global weights in each.

    Shared by the session: copy a checkpoint before editing it."""
    if REASON is not None:
        pytest.skip(REASON)
    from axrl_spike_replay.testing.megatron_checkpoints import save_layouts, tiny_section

    return save_layouts(tmp_path_factory.mktemp("megatron-checkpoints"), tiny_section())
