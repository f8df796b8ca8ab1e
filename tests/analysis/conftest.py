"""Snapshots to analyse: the golden capture (real reference-trainer data) and synthetic snapshots with
planted outliers, saved under canonical, verl and OpenRLHF field names by the real snapshot writer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.synthetic import SyntheticSpec, write_synthetic_snapshot

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


class CliRun:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self) -> object:
        return json.loads(self.out)  # exactly one JSON document, or this raises


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliRun]:
    """Run `axrl-spike-replay ARGS...` in this process; returns exit code, stdout and stderr."""
    from axrl_spike_replay.cli import main

    def run(*argv: str) -> CliRun:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return CliRun(code, captured.out, captured.err)

    return run


class _RunsACommand:
    """Unpickling this runs a shell command: what a malicious snapshot file would carry."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (self.command,))


@pytest.fixture
def write_malicious_pt() -> Callable[[Path, Path], None]:
    """Writes a torch file whose pickle would `touch marker` if anything unpickled it unsafely."""

    def write(path: Path, marker: Path) -> None:
        import torch

        torch.save(
            {"tokens": torch.zeros(2, 4, dtype=torch.long), "advantages": _RunsACommand(f"touch {marker}")}, path
        )

    return write
