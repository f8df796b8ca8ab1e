"""The streamed replay computes in the trainer's recorded precision as the whole replay does: parameters held in
`param_dtype` (the master weights rounded into it as each layer is read), each decoder layer's floating inputs cast,
the head's outputs in `output_dtype`, each pass's gradient reduced in `reduce_dtype`.

Snapshots are recorded in this run (tiny_moe: tests/replay/tiny_snapshot.py; transformers: `testing.hf_snapshot`)
and given a `precision:` section. The whole replay (`worker.compute`, on one intra-op thread with deterministic
algorithms, as every replay process computes: bf16 rounds a different accumulation order differently) and the
streamed one agree to 1e-6 relative, the tolerance of the whole replay's own precision tests against FSDP2
(tests/replay/test_trainer_precision.py); the saved ranks split over 2 processes give the one process's figures bit
for bit, and the float32 step differs (bf16 did run). Nothing here compares with numbers recorded elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_streamed_chain import assert_same_clean, relative_gap
from test_streamed_replay import assert_identical, assert_same, job_of
from test_streamed_signals import assert_same_signals
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.compute.worker import compute
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed
from axrl_spike_replay.replay.streamed.streamed_processes import run_streamed_processes
from axrl_spike_replay.training.precision import PrecisionPolicy
from axrl_spike_replay.vocabulary import Shard

BF16 = {"param_dtype": "bf16", "reduce_dtype": "fp32"}


def with_precision(snapshot: Path, precision: dict[str, Any]) -> None:
    doc = yaml.safe_load((snapshot / "run_config.yaml").read_text(encoding="utf-8"))
    doc["precision"] = precision
    (snapshot / "run_config.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread, deterministic algorithms: how every replay process computes (the test's own back after)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize(
    ("world_size", "precision"),
    [(2, BF16), (4, BF16), (2, {**BF16, "output_dtype": "fp32"})],
)
def test_tiny_moe_streamed_in_the_recorded_precision(
    tmp_path: Path, world_size: int, precision: dict[str, Any]
) -> None:
    snapshot = record_tiny_snapshot(tmp_path, world_size=world_size)
    with one_thread():
        fp32 = compute_streamed(job_of(snapshot))[0].grad_norms[0]
        with_precision(snapshot, precision)
        job = job_of(snapshot, [{"mismatch_token_clip_max": 2}])
        assert job.precision is not None and job.precision.param_dtype == "bfloat16"
        whole, one = compute(job, 0), compute_streamed(job)
    assert_same(whole, one)
    assert relative_gap(whole, one) <= 1e-6
    assert assert_same_signals(whole, one) == 1  # the clean gradient and cosine to it (1e-6)
    assert abs(one[0].grad_norms[0] - fp32) > 1e-6 * fp32  # bf16 did run
    split = run_streamed_processes(job, 2)
    assert_identical(one, split)
    assert assert_same_clean(one, split) == 1


def test_transformers_streamed_in_the_recorded_precision(tmp_path: Path) -> None:
    """qwen3_moe with bf16 parameters and fp32 reduction: rotary buffers stay float32, each layer's call arguments
    (position embeddings, the additive mask) are cast as FSDP casts a unit's inputs."""
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    with one_thread():
        snapshot = record_hf_snapshot(tmp_path, "qwen3_moe", world_size=2)
        with_precision(snapshot, BF16)
        job = job_of(snapshot)
        whole, one = compute(job, 0), compute_streamed(job)
    assert_same(whole, one)
    assert relative_gap(whole, one) <= 1e-6


def test_the_engine_streams_a_bf16_step(tmp_path: Path) -> None:
    """Through the engine: the whole replay's processes and the streamed one give the same grad norm (1e-6) and the
    result says bf16 ran."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    with_precision(snapshot, BF16)
    whole = run_replay(replay_request(What(snapshot), how=How(shard=Shard.OFF, nproc=1)))
    streamed = run_replay(replay_request(What(snapshot), how=How(shard=Shard.STREAMED)))
    assert streamed.precision == whole.precision == PrecisionPolicy("bfloat16", "float32", None, "run_config")
    assert whole.grad_norm is not None and streamed.grad_norm is not None
    assert abs(whole.grad_norm - streamed.grad_norm) <= 1e-6 * whole.grad_norm
