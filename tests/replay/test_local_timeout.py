"""A run here honours `timeout_s`: a replay (in this process: inside a config, between its micro-batches), a streamed
replay (in this process or split over processes), a sweep and an attribution that run past it are stopped with an
error naming the limit; the run dir holds its command, log and failed result
only, a streamed replay's spill dir is gone, and no rank process is left. A request without `timeout_s` runs as
before: the same slow replay completes. Snapshots are recorded in this run (tests/replay/tiny_snapshot.py); the
replays are real, their slowness a progress line that sleeps (in this process) or the start of rank processes."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.cli import main
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.recording import recorder_for
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.processes.rank_processes import RunCancelled
from axrl_spike_replay.processes.run_limit import RunLimit, time_limited
from axrl_spike_replay.replay.compute.model_build import build_model
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import run_job
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.vocabulary import Shard, Verb

LIMIT = 0.05  # seconds: rank processes take longer to start, load the snapshot and meet, even from a warm server
STREAMED_LIMIT = 6.0  # seconds: longer than a loaded host takes to reach the first layer of a streamed replay


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_tiny_snapshot(tmp_path_factory.mktemp("timeout") / "snap", world_size=2)


def _slow(seconds: float, at: str, spill: Path | None = None) -> tuple[list[str], dict[str, bool], object]:
    """A progress sink that sleeps `seconds` once, in the computing thread, when the line `at` first comes (and says
    whether `spill` held boundaries then)."""
    lines: list[str] = []
    seen: dict[str, bool] = {}

    def progress(line: str) -> None:
        lines.append(line)
        if at in line and not seen:
            seen["spilled"] = spill is not None and any(spill.rglob("*"))
            time.sleep(seconds)

    return lines, seen, progress


def _run_files(workspace: Path) -> list[str]:
    runs = list(workspace.glob("tmp/spike-replay/*/*"))
    assert len(runs) == 1, runs
    return sorted(p.name for p in runs[0].iterdir())


def _failed_result(workspace: Path) -> dict:
    return json.loads(next(workspace.glob("tmp/spike-replay/*/*/replay_result.json")).read_text())


def _children(before: set[int]) -> set[int]:
    return {child.pid for child in multiprocessing.active_children()} - before


def test_a_streamed_replay_past_its_timeout_stops_naming_it(snapshot: Path, tmp_path: Path) -> None:
    """Stopped mid-stream: after the first layer's forward, its boundaries spilled to disk (host budget 0)."""
    spill = tmp_path / "spill"
    lines, seen, progress = _slow(STREAMED_LIMIT + 0.3, "forward: layer 1/", spill)
    request = replay_request(
        What(snapshot, mitigations={"advantage_clip": 0.5}),
        Where(timeout_s=STREAMED_LIMIT),
        How(shard=Shard.STREAMED),
        workspace=tmp_path,
        progress=progress,  # type: ignore[arg-type]
    )
    limit = f"{STREAMED_LIMIT:g} s"
    with pytest.raises(AxrlError, match=rf"^replay failed: replay timed out after {limit} \(`timeout_s`\)"):
        run_replay(request, recorder=recorder_for(tmp_path), stream=StreamSettings(0, str(spill)))
    assert seen == {"spilled": True}, lines  # the limit passed mid-stream, with boundaries on disk
    assert not any("layer 2/" in line for line in lines), lines
    assert spill.is_dir() and not any(spill.iterdir())  # the store's dir, removed with what it held
    # what every run dir holds from its start (the baseline's own command beside a mitigated replay's), and the
    # failed result: no half-written output
    assert _run_files(tmp_path) == ["baseline_command.txt", "command.txt", "replay.log", "replay_result.json"]
    doc = _failed_result(tmp_path)
    assert doc["verdict"] == "failed" and doc["grad_norm"] is None
    assert f"timed out after {limit}" in doc["error"]


def test_a_streamed_replay_split_over_processes_is_stopped_at_its_timeout(snapshot: Path, tmp_path: Path) -> None:
    before = {child.pid for child in multiprocessing.active_children()}
    spill = tmp_path / "spill"
    request = replay_request(
        What(snapshot), Where(timeout_s=LIMIT), How(shard=Shard.STREAMED, nproc=2), workspace=tmp_path
    )
    with pytest.raises(AxrlError, match=f"replay timed out after {LIMIT:g} s"):
        run_replay(request, recorder=recorder_for(tmp_path), stream=StreamSettings(0, str(spill)))
    assert not _children(before)
    deadline = time.monotonic() + 30  # a process stopped by a signal leaves its spill dir to its janitor
    while spill.exists() and any(spill.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not spill.exists() or not any(spill.iterdir())
    assert f"timed out after {LIMIT:g} s" in _failed_result(tmp_path)["error"]


def test_a_sweep_of_rank_processes_past_its_timeout_stops_them(snapshot: Path, tmp_path: Path) -> None:
    """A sweep here on 2 spawned processes (whole model each), through `run_request` as the CLI and MCP run it."""
    before = {child.pid for child in multiprocessing.active_children()}
    configs = ({"advantage_clip": 0.5}, {"kl_coef": 0.1})
    request = replay_request(
        What(snapshot, verb=Verb.SWEEP, configs=configs),
        Where(timeout_s=LIMIT),
        How(nproc=2, shard=Shard.OFF),
        workspace=tmp_path,
        job="sweep-limit",
    )
    with pytest.raises(AxrlError, match=f"sweep timed out after {LIMIT:g} s"):
        run_request(request)
    assert not _children(before)
    assert "timed out" in _failed_result(tmp_path)["error"]
    assert not list(tmp_path.glob("tmp/spike-replay/*/*/sweep*.json"))


def test_a_sharded_attribution_past_its_timeout_stops_its_processes(
    snapshot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`attribute --timeout`, as the CLI takes it (the MCP tool's `timeout_s` is the same declared field)."""
    before = {child.pid for child in multiprocessing.active_children()}
    argv = ["attribute", str(snapshot), "--shard", "on", "--nproc", "2", "--workspace", str(tmp_path)]
    assert main([*argv, "--timeout", f"{LIMIT:g}"]) == 2
    assert f"attribution timed out after {LIMIT:g} s (--timeout)" in capsys.readouterr().err
    assert not _children(before)
    assert "attribution.json" not in _run_files(tmp_path)


def test_a_one_process_replay_stops_inside_a_config_at_its_timeout(snapshot: Path, tmp_path: Path) -> None:
    """The whole model in this process: the limit passes once the weights are built, before the first micro-batch's
    pass; the replay stops there, not after the config's every pass (the passes counted on the model's forward)."""
    passes: list[int] = []

    def counted(*args: Any) -> Any:
        model = build_model(*args)
        model.register_forward_pre_hook(lambda module, inputs: passes.append(1))
        return model

    def runner(job: Any, timeout_s: float, cancel: Any = None, *, progress: Any = None, slot: int = 0) -> Any:
        return run_job(job, timeout_s, cancel, models=counted, progress=progress)

    lines, seen, progress = _slow(STREAMED_LIMIT + 0.3, "weights ready")
    request = replay_request(
        What(snapshot),
        Where(timeout_s=STREAMED_LIMIT),
        How(nproc=1, shard=Shard.OFF),
        workspace=tmp_path,
        progress=progress,  # type: ignore[arg-type]
    )
    with pytest.raises(AxrlError, match=rf"^replay failed: replay timed out after {STREAMED_LIMIT:g} s"):
        run_replay(request, recorder=recorder_for(tmp_path), runner=runner)
    assert seen, lines  # the limit passed inside the config, with the weights built
    assert passes == []
    assert not any("computed" in line for line in lines), lines
    # the same replay without a limit makes its passes: at least one per saved rank
    passes.clear()
    done = run_replay(replace(request, where=Where(), progress=None), runner=runner)
    assert done.verdict == "reproduced" and len(passes) >= 2


def test_a_request_without_timeout_runs_as_before(snapshot: Path, tmp_path: Path) -> None:
    """The slow streamed replay that was stopped above completes when no limit is asked."""
    _, seen, progress = _slow(STREAMED_LIMIT + 0.3, "forward: layer 1/")
    request = replay_request(What(snapshot), how=How(shard=Shard.STREAMED), progress=progress)  # type: ignore[arg-type]
    assert request.where.timeout_s is None
    result = run_replay(request, stream=StreamSettings(0, str(tmp_path / "spill")))
    assert seen and result.verdict == "reproduced" and result.grad_norm is not None


def test_the_limit_is_the_cancel_flag_and_a_cancel_stays_a_cancel() -> None:
    assert not RunLimit(None, None).is_set() and not RunLimit(threading.Event(), 60.0).is_set()
    assert RunLimit(None, 0.0).is_set() or time.sleep(0.01) or RunLimit(None, 0.0).passed
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RunCancelled, match=r"^replay cancelled$"), time_limited(cancel, 0.0, "replay") as limit:
        time.sleep(0.01)
        assert limit.is_set()
        raise RunCancelled("replay cancelled")  # the caller's cancel: not said to be the limit
