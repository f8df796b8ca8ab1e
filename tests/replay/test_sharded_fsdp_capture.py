"""A spike captured by an FSDP2 trainer at world size 4 (its weights a DCP checkpoint in four chunks, its precision
in the run config) replays sharded: at full fidelity on 4 processes, reduced on 2, each process reading only the
rows of its own shards from the four saved chunks (DCP reshards on load)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from axrl_spike_replay.capture.reference.reference_trainer import CaptureResult, capture_reference_run
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.vocabulary import Shard

pytestmark = pytest.mark.slow  # a four-rank capture and two sharded replays

SHORT = {"train": {"burst": [6]}, "detector": {"window": 4, "warmup": 4}}


@pytest.fixture(scope="module")
def fsdp4_run(tmp_path_factory: pytest.TempPathFactory) -> CaptureResult:
    out = tmp_path_factory.mktemp("fsdp4")
    return capture_reference_run(out, job="fsdp4-moe", world_size=4, steps=7, parallel="fsdp", overrides=SHORT)


def test_the_capture_records_its_precision(fsdp4_run: CaptureResult) -> None:
    snapshot = fsdp4_run.snapshot_dirs[0]
    config = yaml.safe_load((snapshot / "run_config.yaml").read_text(encoding="utf-8"))
    assert config["precision"] == {"param_dtype": "float32", "reduce_dtype": "float32", "output_dtype": None}
    assert sorted(p.name for p in snapshot.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]


def test_a_world_size_4_snapshot_replays_sharded_full_on_4_and_reduced_on_2(fsdp4_run: CaptureResult) -> None:
    snapshot: Path = fsdp4_run.snapshot_dirs[0]
    full = run_replay(replay_request(What(snapshot), how=How(nproc=4, shard=Shard.ON)))
    assert full.sharded is True and full.fidelity == "full"
    assert (full.world_size_saved, full.world_size_used) == (4, 4)
    assert full.rel_diff is not None and full.rel_diff <= 1e-6 and full.verdict == "reproduced"
    assert full.precision is not None and full.precision.source == "run_config"
    reduced = run_replay(replay_request(What(snapshot), how=How(nproc=2, shard=Shard.ON)))
    assert reduced.sharded is True and reduced.fidelity == "full"
    assert (reduced.world_size_saved, reduced.world_size_used) == (4, 2)
    assert reduced.rel_diff is not None and reduced.rel_diff <= 1e-5 and reduced.verdict == "reproduced"
    assert full.grad_norm is not None and reduced.grad_norm is not None
    assert abs(full.grad_norm - reduced.grad_norm) <= 1e-6 * full.grad_norm
