"""Session fixtures shared by every test area: a reference-trainer capture and a copy of the golden fixtures."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"

# One intra-op thread: deterministic reductions (as in every rank process) and no oversubscription.
torch.set_num_threads(1)


# Fixtures that run a training capture, rank processes or an SSH server: a test using one is `heavy`.
_HEAVY_FIXTURES = {"captured_run", "ssh_node"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the heavy tests (captures, slow ones, SSH loopback) so `-m "not heavy"` gives a quick run.

    The default run (scripts/test.sh) still runs every test; the marker only lets a person leave them out.
    """
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        in_capture = Path(str(item.fspath)).parent.name == "capture"
        marked = item.get_closest_marker("slow") or item.get_closest_marker("sshd")
        if in_capture or fixtures & _HEAVY_FIXTURES or marked:
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(scope="session")
def captured_run(tmp_path_factory: pytest.TempPathFactory):
    """CaptureResult of a reference run: world size 2, preset ratio_outliers, spikes at iterations 20-22."""
    from axrl_spike_replay.capture.reference_trainer import capture_reference_run

    logging.getLogger("axrl_spike_replay.guard").setLevel(logging.ERROR)
    out = tmp_path_factory.mktemp("captured-run")
    return capture_reference_run(out, job="demo-moe-grpo", world_size=2, preset="ratio_outliers", seed=0)


@pytest.fixture(scope="session")
def fixture_outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary copy of tests/fixtures/outputs (the golden job output dirs), safe to modify."""
    target = tmp_path_factory.mktemp("fixture-outputs") / "outputs"
    shutil.copytree(FIXTURES_DIR / "outputs", target)
    return target


class CliRun:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self) -> object:
        import json

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
def write_malicious_pt() -> Callable[..., None]:
    """Writes a `.pt` whose pickle would `touch marker` if anything unpickled it unsafely."""

    def write(path: Path, marker: Path, *, zip_format: bool = True) -> None:
        import pickle

        import torch

        payload = {"tokens": torch.zeros(2, 4, dtype=torch.long), "loss_mask": _RunsACommand(f"touch {marker}")}
        if zip_format:
            torch.save(payload, path)
        else:
            path.write_bytes(pickle.dumps(payload, protocol=2))

    return write
