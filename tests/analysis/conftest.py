"""Snapshots to analyse: the golden capture (real reference-trainer data) and synthetic snapshots with
planted outliers, saved under canonical, verl and OpenRLHF field names by the real snapshot writer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot

FIXTURE_OUTPUTS = Path(__file__).resolve().parents[1] / "fixtures" / "outputs"


@pytest.fixture(scope="session")
def golden_output_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the golden current-layout output dir (world size 2, routing payloads, a log)."""
    source = FIXTURE_OUTPUTS / "fx~fixture-moe__actor"
    if not source.is_dir():
        pytest.skip("golden fixtures missing: run scripts/make_fixtures.py")
    dest = tmp_path_factory.mktemp("golden") / source.name
    shutil.copytree(source, dest)
    return dest


@pytest.fixture(scope="session")
def golden_snapshot(golden_output_dir: Path) -> Path:
    return sorted((golden_output_dir / SNAPSHOTS_DIR).glob("iter_*"))[-1]


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """synthetic(naming="canonical", **spec) -> snapshot dir; one per distinct spec for the session."""
    made: dict[str, Path] = {}

    def make(naming: str = "canonical", **overrides: object) -> Path:
        key = json.dumps({"naming": naming, **overrides}, sort_keys=True, default=str)
        if key not in made:
            root = tmp_path_factory.mktemp(f"synthetic-{naming}") / "run1~synth__actor" / SNAPSHOTS_DIR
            made[key] = write_synthetic_snapshot(root, SyntheticSpec(naming=naming, **overrides))
        return made[key]

    return make
