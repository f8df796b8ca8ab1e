"""Snapshots to find, preserve and read: the golden fixtures (a real reference-trainer capture) and small
synthetic ones written by the real snapshot writer, copied per test when a test changes them."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot

FIXTURE_OUTPUTS = Path(__file__).resolve().parents[1] / "fixtures" / "outputs"
GOLDEN_CURRENT = "fx~fixture-moe__actor"
GOLDEN_LEGACY = "fx~fixture-legacy__actor"


@pytest.fixture(scope="session")
def golden_outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of tests/fixtures/outputs (read by many tests; never changed)."""
    if not (FIXTURE_OUTPUTS / GOLDEN_CURRENT).is_dir():
        pytest.skip("golden fixtures missing: run scripts/make_fixtures.py")
    dest = tmp_path_factory.mktemp("golden") / "outputs"
    shutil.copytree(FIXTURE_OUTPUTS, dest, symlinks=True)
    return dest


def _only_snapshot(output_dir: Path) -> Path:
    return sorted((output_dir / SNAPSHOTS_DIR).glob("iter_*"))[-1]


@pytest.fixture(scope="session")
def golden_snapshot(golden_outputs: Path) -> Path:
    """The newest snapshot of the golden current-layout output dir (world size 2, routing payloads)."""
    return _only_snapshot(golden_outputs / GOLDEN_CURRENT)


@pytest.fixture(scope="session")
def golden_legacy_snapshot(golden_outputs: Path) -> Path:
    return _only_snapshot(golden_outputs / GOLDEN_LEGACY)


@pytest.fixture(scope="session")
def synthetic_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output dir `run1~synth__actor` with two retained synthetic snapshots (iterations 41, 42) and a log."""
    out = tmp_path_factory.mktemp("template") / "run1~synth__actor"
    for iteration in (41, 42):
        write_synthetic_snapshot(out / SNAPSHOTS_DIR, SyntheticSpec(iteration=iteration, seed=iteration))
    (out / "logs").mkdir()
    (out / "logs" / "train.log").write_text("step=1 grad_norm=1.0 loss=0.5\n")
    return out


@pytest.fixture
def make_output_dir(tmp_path: Path, synthetic_template: Path) -> Callable[[], Path]:
    """A fresh copy of the synthetic output dir, for tests that preserve, release or break things."""

    def make(name: str = "run1~synth__actor") -> Path:
        dest = tmp_path / name
        shutil.copytree(synthetic_template, dest)
        return dest

    return make
