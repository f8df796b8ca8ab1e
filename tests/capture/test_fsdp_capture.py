"""An FSDP2 trainer's spike: the policy sharded with fully_shard over gloo, its weights a sharded DCP checkpoint.

A user training with FSDP (verl's actor, torchtitan, ...) gets snapshots whose weights are the sharded
state dict, one chunk per rank. The replay loads them unsharded (one process) or at the saved layout,
and the no-mitigation replay of a snapshot captured here is bit-identical to training.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from axrl_spike_replay.capture.reference.reference_trainer import CaptureResult, capture_reference_run
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.dcp.checkpoint import read_checkpoint_metadata
from axrl_spike_replay.snapshot.rank_data import load_grad_info

# A short run: the burst at iteration 6 after a 4-step warm-up keeps this test to seconds.
pytestmark = pytest.mark.slow  # a two-rank capture and replays: tens of seconds on two cores

SHORT = {"train": {"burst": [6]}, "detector": {"window": 4, "warmup": 4}}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> CaptureResult:
    out = tmp_path_factory.mktemp("fsdp")
    return capture_reference_run(out, job="fsdp-moe", world_size=2, steps=7, parallel="fsdp", overrides=SHORT)


def test_the_fsdp_run_trips_the_guard_and_records_the_strategy(fsdp_run: CaptureResult) -> None:
    assert fsdp_run.spike_iterations == [6]
    assert fsdp_run.summary()["parallel"] == "fsdp"
    snapshot = fsdp_run.snapshot_dirs[0]
    config = yaml.safe_load((snapshot / "run_config.yaml").read_text(encoding="utf-8"))
    assert config["parallel"]["strategy"] == "fsdp"
    assert config["parallel"]["world_size"] == 2


def test_the_weights_are_a_sharded_dcp_checkpoint_one_chunk_per_rank(fsdp_run: CaptureResult) -> None:
    snapshot = fsdp_run.snapshot_dirs[0]
    assert sorted(p.name for p in snapshot.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    metadata = read_checkpoint_metadata(snapshot)
    embed = metadata.state_dict_metadata["model.embed.weight"]
    assert [tuple(c.offsets) for c in embed.chunks] == [(0, 0), (embed.size[0] // 2, 0)]
    files = {info.relative_path for info in metadata.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}
    assert metadata.storage_meta.checkpoint_id == snapshot.name  # not the writer's staging path


def test_replay_at_the_saved_layout_is_bit_identical(fsdp_run: CaptureResult) -> None:
    snapshot = fsdp_run.snapshot_dirs[0]
    result = run_replay(replay_request(What(snapshot), how=How(nproc=2)))
    assert result.fidelity == "full"
    assert result.grad_norm == result.recorded_grad_norm
    assert result.rel_diff == 0.0
    # each rank's norms of its shard of the reduced gradient, merged, are the replay's per-parameter norms
    assert result.consistency is not None and "param_grad_norms_vs_replay" in result.consistency.checked
    assert result.consistency.self_consistent, result.consistency.problems


def test_replay_in_one_process_loads_the_shards_unsharded(fsdp_run: CaptureResult) -> None:
    result = run_replay(replay_request(What(fsdp_run.snapshot_dirs[0]), how=How(nproc=1)))
    assert result.fidelity == "full"  # one process for both saved ranks: every saved rank replayed
    assert result.rel_diff is not None and result.rel_diff <= 1e-5
    assert result.consistency is not None and "param_grad_norms_vs_replay" in result.consistency.checked
    assert result.consistency.self_consistent, result.consistency.problems


def test_fsdp_own_norm_is_recorded_beside_the_guard_norm(fsdp_run: CaptureResult) -> None:
    info = load_grad_info(fsdp_run.snapshot_dirs[0], 0)
    assert info["param_grad_norms_kind"] == "reduced_shard"
    # FSDP's clip computes in fp32 from per-shard norms; the guard's norm is fp64 over the full gradients.
    assert abs(info["fsdp_total_norm"] - info["grad_norm"]) <= 1e-6 * info["grad_norm"]
    merged = sum(load_grad_info(fsdp_run.snapshot_dirs[0], r)["param_grad_norms"]["head.weight"] ** 2 for r in (0, 1))
    assert merged > 0.0


def test_an_unknown_strategy_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="parallel must be one of ddp, fsdp"):
        capture_reference_run(tmp_path, parallel="zero3")


def test_the_cli_takes_parallel_fsdp(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "axrl_spike_replay", "capture", "--out", str(tmp_path), "--parallel", "nope"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert "--parallel" in proc.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "axrl_spike_replay", "capture", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--parallel" in help_text and "fsdp" in help_text
