"""Snapshots the replay tests share: copies of the golden reference-trainer captures and a tiny recorded one."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_snapshot import record_tiny_snapshot

from shared_capture import made_once

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "outputs"
SNAPSHOTS = Path("checkpoints") / "spike_snapshots"


def snapshots_of(output_dir: Path) -> list[Path]:
    """The `iter_<N>` snapshots of a job output dir, oldest first."""
    return sorted((output_dir / SNAPSHOTS).glob("iter_*"))


@pytest.fixture(scope="session")
def golden_outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of tests/fixtures/outputs (world size 2 ratio_outliers captures, current and legacy)."""
    dest = tmp_path_factory.mktemp("replay-golden") / "outputs"
    shutil.copytree(GOLDEN, dest)
    return dest


@pytest.fixture(scope="session")
def spike_snapshot(golden_outputs: Path) -> Path:
    """A real reference-trainer spike snapshot (ratio_outliers burst, saved world size 2)."""
    return snapshots_of(golden_outputs / "fx~fixture-moe__actor")[-1]


@pytest.fixture(scope="session")
def legacy_snapshot(golden_outputs: Path) -> Path:
    """The same kind of capture in the legacy layout (AXRL keys in metadata.json)."""
    return snapshots_of(golden_outputs / "fx~fixture-legacy__actor")[-1]


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny recorded spike whose burst samples are known: rank 0 sample 1 and rank 1 sample 2. Recorded once per
    run (`made_once`: one recording for every pytest-xdist worker); read it, or copy it before editing it."""
    _, snapshot = made_once(
        tmp_path_factory, "tiny", lambda root: str(record_tiny_snapshot(root / "spike_snapshots", world_size=2))
    )
    return Path(snapshot)


@pytest.fixture
def snapshot_copy(spike_snapshot: Path, tmp_path: Path) -> Callable[[], Path]:
    """A fresh copy of the spike snapshot that a test may break."""

    copies = iter(range(1000))

    def make() -> Path:
        dest = tmp_path / f"copy{next(copies)}" / spike_snapshot.name
        shutil.copytree(spike_snapshot, dest)
        return dest

    return make


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    root.mkdir()
    return root
