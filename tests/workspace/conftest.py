"""A real tiny spike snapshot for the investigation-record tests."""

from __future__ import annotations

import pytest
from record_helpers import ITERATION, JOB, MEDIAN, RECORDED, THRESHOLD, SpikeRun

from tiny_spike import write_tiny_spike


@pytest.fixture(scope="session")
def spike_run(tmp_path_factory: pytest.TempPathFactory) -> SpikeRun:
    """One output dir `run1~fixture-moe__actor` holding a real snapshot (tiny MoE, world size 2)."""
    output_dir = tmp_path_factory.mktemp("outputs") / f"run1~{JOB}__actor"
    snapshot = write_tiny_spike(
        output_dir, job=JOB, iteration=ITERATION, recorded=RECORDED, median=MEDIAN, threshold=THRESHOLD
    )
    return SpikeRun(output_dir=output_dir, snapshot=snapshot, iteration=ITERATION)
