"""Session fixtures shared by every test area: a reference-trainer capture and a copy of the golden fixtures."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"

# One intra-op thread: deterministic reductions (as in every rank process) and no oversubscription.
torch.set_num_threads(1)


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
