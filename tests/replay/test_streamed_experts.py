"""Each MoE layer's routed experts split over gloo processes (`expert_share`): every process streams every saved
rank with its block of each layer's experts (2 processes: half of them each; 4: one of tiny_moe's 4 each), their
routed outputs and input gradients all-reduced.

The step's figures (grad norm, per-parameter norms, each rank's norms, top parameters, losses, footprints, the clean
gradient and the cosines to it) are the one-process streamed replay's to 1e-6, but for the split expert weights'
norms: the split takes them from float64 sums of squares (its parts' put together), the one process as the trainer
records them, a float32 norm, itself up to ~3e-6 off the float64 one on these tensors. Those are checked against the
same code over one process (every expert in it, the same float64 norms) to 1e-6, and against the one-process
streamed replay's float32 norms to 1e-5.

Snapshots are recorded in this run with the trainer's own step functions (tiny_moe: tests/replay/tiny_snapshot.py;
transformers: `testing.hf_snapshot`). Nothing here compares with numbers recorded elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from test_streamed_replay import CONFIGS, assert_same, job_of
from test_streamed_signals import CONFIGS as MITIGATIONS
from test_streamed_signals import assert_same_signals
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed
from axrl_spike_replay.replay.streamed.streamed_processes import run_streamed_processes

FLOAT32_NORM = 1e-5  # a float32 norm's own rounding on these tensors (measured up to ~3e-6), with room


def near(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1e-30)


def assert_same_but_float32_norms(one: Sequence[ConfigOutcome], split: Sequence[ConfigOutcome]) -> None:
    """The one-process streamed replay's figures to 1e-6; an expert weight's norms to a float32 norm's rounding."""
    for a, b in zip(one, split, strict=True):
        assert a.config_id == b.config_id and near(a.grad_norms[0], b.grad_norms[0], 1e-6)
        assert [m["loss"] for m in a.rank_metrics] == pytest.approx([m["loss"] for m in b.rank_metrics], rel=1e-6)
        assert a.footprint == b.footprint
        pairs = [(a.param_grad_norms or {}, b.param_grad_norms or {})]
        pairs += [(own, (b.rank_param_grad_norms or {})[r]) for r, own in (a.rank_param_grad_norms or {}).items()]
        pairs += [
            ({p["name"]: p["grad_norm"] for p in a.top_params}, {p["name"]: p["grad_norm"] for p in b.top_params})
        ]
        for x, y in pairs:
            assert x.keys() == y.keys()
            for name, value in x.items():
                assert near(value, y[name], FLOAT32_NORM if ".experts." in name or ".w_" in name else 1e-6), name


def split_twice(job: WorkerJob, processes: int) -> tuple[list[ConfigOutcome], list[ConfigOutcome]]:
    """The job with the experts in one process, then split over `processes` (the same code both times)."""
    return run_streamed_processes(job, 1, experts=True), run_streamed_processes(job, processes, experts=True)


@pytest.mark.parametrize("world_size", [1, 2])
def test_experts_split_over_two_processes_are_the_one_process_replay(tmp_path: Path, world_size: int) -> None:
    """Each process holds half of every MoE layer's expert weights and says so; the baseline's and two configs'
    figures are the one process's."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=world_size)
    job = job_of(snapshot, CONFIGS[:2])
    lines: list[str] = []
    split = run_streamed_processes(job, 2, progress=lines.append, experts=True)
    assert_same(run_streamed_processes(job, 1, experts=True), split)
    assert_same_but_float32_norms(compute_streamed(job), split)
    held = [line for line in lines if "expert weights" in line]
    assert sorted(held) == [
        f"process {p}: streamed: this process holds 16,384 of 32,768 bytes of the MoE layers' expert weights"
        for p in (0, 1)
    ]


def test_one_expert_per_process_at_world_size_four(tmp_path: Path) -> None:
    """4 saved ranks, 4 experts over 4 processes: each holds one expert of each layer."""
    job = job_of(record_tiny_snapshot(tmp_path, world_size=4), CONFIGS[:1])
    whole, split = split_twice(job, 4)
    assert_same(whole, split)
    assert_same_but_float32_norms(compute_streamed(job), split)


def test_mitigations_clean_gradient_and_cosines_with_experts_split(tmp_path: Path) -> None:
    """A spike carried by one sample's advantage; a mitigation on the baseline's forward, one masking samples, one
    on another forward (routing off): the clean gradient's search, each cosine and each footprint over 2
    processes."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=2, burst=False, advantage_outlier=(0, 1, 200.0))
    job = job_of(snapshot, MITIGATIONS)
    one = compute_streamed(job)
    split = run_streamed_processes(job, 2, experts=True)
    assert_same_but_float32_norms(one, split)
    assert assert_same_signals(one, split) == len(MITIGATIONS)
    clean = split[1].clean_gradient
    assert clean is not None and clean["reached"] and clean["passes"] > 1 and "0:1" in clean["left_out"]


@pytest.mark.parametrize("architecture", ["qwen2_moe", "qwen3_moe"])
def test_transformers_experts_split_over_two_processes(tmp_path: Path, architecture: str) -> None:
    """qwen2_moe (a shared expert, computed by every process) and qwen3_moe at world size 2: each process holds
    half of every layer's stacked expert weights (4 of 8 experts)."""
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    job = job_of(record_hf_snapshot(tmp_path, architecture, world_size=2), CONFIGS[:1])
    whole, split = split_twice(job, 2)
    assert_same(whole, split)
    assert_same_but_float32_norms(compute_streamed(job), split)


def test_experts_split_refused_by_name_where_not_built(tmp_path: Path) -> None:
    """An architecture not built is refused naming it, and more processes than experts naming `nproc`, before any
    process starts."""
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    mixtral = job_of(record_hf_snapshot(tmp_path / "hf", "mixtral", world_size=1))
    with pytest.raises(ConfigError, match="built for tiny_moe, qwen2_moe and qwen3_moe, not mixtral") as refused:
        run_streamed_processes(mixtral, 2, experts=True)
    assert refused.value.parameter == "nproc"
    tiny = job_of(record_tiny_snapshot(tmp_path / "tiny", world_size=1))
    with pytest.raises(ConfigError, match="4 experts per layer split over 1 to 4 processes, not 5"):
        run_streamed_processes(tiny, 5, experts=True)
