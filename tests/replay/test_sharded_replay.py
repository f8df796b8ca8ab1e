"""Sharded replay: the policy split with FSDP2 over 1, 2 or 4 gloo processes gives the unsharded replay's grad norms
and verdicts, for the toy model and for transformers MoE architectures (qwen2_moe has shared experts).

Each sweep runs the baseline, two loss-level mitigations sharing its forward, and one that changes the forward
(routing replay off), so the clean gradient, the footprints and the cosine to the clean gradient are all computed
from sharded gradients too. The unsharded replay at the saved world size is the reference.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.result import SweepResult
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.sweep import run_sweep
from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot
from axrl_spike_replay.vocabulary import Shard, Verb

pytestmark = pytest.mark.slow  # several 1-4 process replays per model: minutes on two cores

REL = 1e-6
CONFIGS = [{"mismatch_token_clip_max": 2}, {"advantage_clip": 0.5}, {"routing_replay": "off"}]


def _rel(a: float | None, b: float | None) -> float:
    assert a is not None and b is not None
    return abs(a - b) / abs(b)


def _same_sweep(sharded: SweepResult, whole: SweepResult) -> None:
    """Every config's grad norm within REL, the same verdicts, the same clean-gradient figures."""
    rows = [sharded.baseline, *sharded.results]
    reference = [whole.baseline, *whole.results]
    for got, want in zip(rows, reference, strict=True):
        assert got.config_id == want.config_id
        assert _rel(got.grad_norm, want.grad_norm) <= REL, (got.config_id, got.grad_norm, want.grad_norm)
        assert got.verdict == want.verdict, got.config_id
        assert got.sharded is True and want.sharded is False
        assert [p.name for p in got.top_params[:3]] == [p.name for p in want.top_params[:3]]
        for p, q in zip(got.top_params, want.top_params, strict=True):
            assert p.grad_norm is not None and q.grad_norm is not None
            assert math.isclose(p.grad_norm, q.grad_norm, rel_tol=1e-5, abs_tol=1e-9)
        if want.cosine_to_clean is not None:
            assert got.cosine_to_clean is not None and abs(got.cosine_to_clean - want.cosine_to_clean) <= 1e-6
        if want.footprint:
            assert got.footprint == want.footprint
    clean, want_clean = sharded.results[0].clean_gradient, whole.results[0].clean_gradient
    assert want_clean is not None and clean is not None
    assert clean.left_out == want_clean.left_out


def _sweep(snapshot: Path, nproc: int, shard: str) -> SweepResult:
    return run_sweep(
        replay_request(
            What(snapshot, verb=Verb.SWEEP, configs=tuple(CONFIGS)), how=How(nproc=nproc, shard=Shard(shard))
        )
    )


@pytest.fixture(scope="module")
def toy_world4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SweepResult]:
    """The toy model's spike at saved world size 4, swept unsharded at full fidelity."""
    snapshot = record_tiny_snapshot(tmp_path_factory.mktemp("toy4") / "spike_snapshots", world_size=4)
    return snapshot, _sweep(snapshot, 4, "off")


@pytest.mark.parametrize(
    "nproc", [pytest.param(1, marks=pytest.mark.matrix), 2, pytest.param(4, marks=pytest.mark.matrix)]
)
def test_a_sharded_toy_sweep_gives_the_unsharded_norms_and_verdicts(
    toy_world4: tuple[Path, SweepResult], nproc: int
) -> None:
    snapshot, whole = toy_world4
    sharded = _sweep(snapshot, nproc, "on")
    _same_sweep(sharded, whole)
    assert sharded.baseline.fidelity == "full"
    assert sharded.baseline.world_size_used == nproc
    assert sharded.baseline.verdict == "reproduced"


@pytest.fixture(scope="module")
def hf_world4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SweepResult]:
    """The tiny transformers model `request.param` (an architecture) spiking at saved world size 4, swept unsharded
    over two processes."""
    snapshot = record_hf_snapshot(tmp_path_factory.mktemp(request.param), request.param, world_size=4)
    return snapshot, _sweep(snapshot, 2, "off")


@pytest.mark.parametrize(
    ("hf_world4", "nproc"),
    [
        ("qwen3_moe", 2),
        *(pytest.param("qwen3_moe", n, marks=pytest.mark.matrix) for n in (1, 4)),
        *(pytest.param("qwen2_moe", n, marks=pytest.mark.matrix) for n in (1, 2, 4)),  # a shared expert per layer
    ],
    indirect=["hf_world4"],
)
def test_a_sharded_transformers_sweep_gives_the_unsharded_norms_and_verdicts(
    hf_world4: tuple[Path, SweepResult], nproc: int
) -> None:
    snapshot, whole = hf_world4
    sharded = _sweep(snapshot, nproc, "on")
    _same_sweep(sharded, whole)
    assert sharded.baseline.fidelity == "full"
    assert sharded.baseline.world_size_used == nproc


def test_sharding_auto_stays_whole_when_the_model_fits(toy_world4: tuple[Path, SweepResult]) -> None:
    snapshot, whole = toy_world4
    result = run_replay(replay_request(What(snapshot), how=How(nproc=2)))  # shard auto: a toy model fits any process
    assert result.sharded is False
    assert result.shard_reason.startswith("shard auto: the replay plan's whole-model peak")
    assert "fits (" in result.shard_reason and "this machine" in result.shard_reason
    assert _rel(result.grad_norm, whole.baseline.grad_norm) <= REL


def test_a_replay_that_does_not_fit_shards_by_itself(toy_world4: tuple[Path, SweepResult]) -> None:
    from axrl_spike_replay.replay.plans.replay_plan import Capacity, plan_replay

    snapshot, whole = toy_world4
    roomy = Capacity("a large machine", "cpu", 1, 1 << 40, "test")
    need = plan_replay(snapshot, nproc=2, capacity=roomy, shard="off").chosen
    assert need is not None and not need.checkpointed
    # just below that, the whole model still fits with its decoder layers checkpointed; below both, it shards
    tight = Capacity("a tight machine", "cpu", 1, need.per_device - 1, "test")
    checkpointed = plan_replay(snapshot, nproc=2, capacity=tight, shard="off").chosen
    assert checkpointed is not None and checkpointed.checkpointed and checkpointed.per_device < need.per_device
    small = Capacity("a small machine", "cpu", 1, checkpointed.per_device - 1, "test")  # no whole process fits
    result = run_replay(replay_request(What(snapshot), how=How(nproc=2)), capacity=small)
    assert result.sharded is True
    assert "does not fit" in result.shard_reason and "a small machine" in result.shard_reason
    assert _rel(result.grad_norm, whole.baseline.grad_norm) <= REL
    kept = run_replay(
        replay_request(What(snapshot), how=How(nproc=2)),
        capacity=Capacity("a large machine", "cpu", 1, need.per_device, "test"),
    )
    assert kept.sharded is False and "fits (" in kept.shard_reason


def test_a_bad_shard_value_names_the_option(toy_world4: tuple[Path, SweepResult]) -> None:
    snapshot, _ = toy_world4
    with pytest.raises(ConfigError, match="`shard` must be one of auto, on, off") as caught:
        replay_request(What(snapshot), how=How(shard="sometimes"))  # type: ignore[arg-type]
    assert caught.value.parameter == "shard"


def test_a_warm_pool_replays_sharded_and_keeps_its_shards_and_a_cancel_leaves_it_usable(
    toy_world4: tuple[Path, SweepResult],
) -> None:
    import threading

    from axrl_spike_replay.processes.rank_processes import RunCancelled
    from axrl_spike_replay.replay.jobs.warm_pool import WarmService

    snapshot, whole = toy_world4
    warm = WarmService()
    try:
        lines: list[str] = []
        first = run_replay(
            replay_request(What(snapshot), how=How(nproc=2, shard=Shard.ON), progress=lines.append), runner=warm.run_job
        )
        [pids] = warm.pools().values()
        assert first.sharded is True and _rel(first.grad_norm, whole.baseline.grad_norm) <= REL
        assert any("sharded:" in line and "parameters here" in line for line in lines), lines
        cancel = threading.Event()

        def cancel_once_loaded(line: str) -> None:
            if "loaded" in line:
                cancel.set()

        with pytest.raises(RunCancelled):
            run_replay(
                replay_request(
                    What(snapshot), how=How(nproc=2, shard=Shard.ON), cancel=cancel, progress=cancel_once_loaded
                ),
                runner=warm.run_job,
            )
        again = run_replay(replay_request(What(snapshot), how=How(nproc=2, shard=Shard.ON)), runner=warm.run_job)
        assert again.grad_norm == first.grad_norm  # the same processes and shards: bit for bit
        assert list(warm.pools().values()) == [pids]
    finally:
        warm.close()


def test_processes_torchrun_starts_run_their_share_of_a_sharded_replay(
    toy_world4: tuple[Path, SweepResult], tmp_path: Path
) -> None:
    """The seam a launcher uses: a `runner` that hands the engine's job to processes torchrun started, each calling
    `replay.jobs.job_runner.run_share`; rank 0's outcomes come back to the engine, which writes the result as usual."""
    import json
    import pickle
    import subprocess
    import sys

    from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob

    snapshot, whole = toy_world4
    worker = Path(__file__).with_name("torchrun_share_worker.py")

    def torchrun(job: WorkerJob, timeout_s: float = 600.0, cancel: object = None, **_: object) -> list[ConfigOutcome]:
        job_file, outcomes = tmp_path / "job.pkl", tmp_path / "outcomes.json"
        job_file.write_bytes(pickle.dumps(job))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        done = subprocess.run(
            [*argv, str(worker), str(job_file), str(outcomes)], capture_output=True, text=True, timeout=timeout_s
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return [ConfigOutcome(**item) for item in json.loads(outcomes.read_text(encoding="utf-8"))]

    result = run_replay(replay_request(What(snapshot), how=How(nproc=2, shard=Shard.ON)), runner=torchrun)
    assert result.sharded is True and result.fidelity == "full" and result.verdict == "reproduced"
    assert _rel(result.grad_norm, whole.baseline.grad_norm) <= REL


def test_the_cli_shards_on_request_and_records_it(toy_world4: tuple[Path, SweepResult], tmp_path: Path, cli) -> None:
    snapshot, whole = toy_world4
    run = cli("replay", snapshot, "--nproc", "2", "--shard", "on", "--workspace", tmp_path, "--json")
    assert run.code == 0, run.err
    doc = run.json()
    assert isinstance(doc, dict) and doc["sharded"] is True
    assert _rel(doc["grad_norm"], whole.baseline.grad_norm) <= REL
    command = (Path(doc["output_dir"]) / "command.txt").read_text(encoding="utf-8")
    assert "--shard on" in command  # the command that reproduces this run says it sharded
