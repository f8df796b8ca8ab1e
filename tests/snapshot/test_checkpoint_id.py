"""The checkpoint `.metadata` a snapshot writer produces records the snapshot's own name as its checkpoint id, never
the writer's temporary absolute path (which every preserved or copied snapshot would carry)."""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.snapshot.dcp.checkpoint import read_checkpoint_metadata
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot


def test_the_checkpoint_id_is_the_snapshot_name_not_the_staging_path(tmp_path: Path) -> None:
    snapshot = write_synthetic_snapshot(tmp_path / "spike_snapshots", SyntheticSpec(iteration=42))

    metadata = read_checkpoint_metadata(snapshot)
    assert metadata.storage_meta.checkpoint_id == "iter_0000042"
    raw = (snapshot / ".metadata").read_bytes()
    assert str(tmp_path).encode() not in raw and b".writing" not in raw
