"""Whether a snapshot's DCP checkpoint fits the tiny MoE model its run config names, read without building it."""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.models.tiny_moe import TinyMoEConfig, expected_state_shapes
from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage, summarize_checkpoint


def check_tiny_moe_weights(directory: Path, model: TinyMoEConfig, label: str) -> None:
    """SnapshotError unless the DCP checkpoint holds every model tensor with the shape the model needs,
    and every size its `.metadata` declares is backed by its data files. Builds no module."""
    expected = expected_state_shapes(model)
    saved = summarize_checkpoint(directory).shapes
    missing = sorted(name for name in expected if f"model.{name}" not in saved)
    wrong = sorted(
        f"{name} {saved[f'model.{name}'][0]} (model needs {shape})"
        for name, shape in expected.items()
        if f"model.{name}" in saved and saved[f"model.{name}"][0] != shape
    )
    if missing or wrong:
        problems = ([f"missing {', '.join(missing[:5])}"] if missing else []) + wrong[:5]
        raise SnapshotError(f"{directory}: {label} does not fit the run config's model: {'; '.join(problems)}")
    oversized = check_checkpoint_storage(directory)
    if oversized:
        raise SnapshotError(f"{label}: {oversized[0]}")
