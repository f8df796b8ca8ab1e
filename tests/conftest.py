"""Session fixtures shared by every test area: one reference-trainer capture per preset and a copy of the golden
fixtures.

A shared capture is recorded once per run (once for all pytest-xdist workers: `shared_capture.made_once`) and read
by tests in several folders: a test that edits a snapshot works on its own copy (shutil.copytree into tmp_path); at
the end of each worker's session each shared capture is checked to be as it was recorded.
"""

from __future__ import annotations

import logging
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from axrl_spike_replay.processes.process_starts import preload_for
from shared_capture import left_as_recorded, made_once

if TYPE_CHECKING:
    from axrl_spike_replay.capture.reference.reference_trainer import CaptureResult
    from axrl_spike_replay.replay.jobs.job_runner import JobRunner

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"

# The suite replays transformers and Megatron snapshots in many rank processes: this process's process server
# imports those libraries once, before it forks them, instead of each rank importing them again.
preload_for("hf", "megatron")

# One intra-op thread: deterministic reductions (as in every rank process) and no oversubscription.
torch.set_num_threads(1)

# A suite started as a background job of a non-interactive shell inherits SIGINT ignored, and so would every process
# it starts: the Ctrl-C tests send SIGINT to a child as a person's terminal would, so it must not arrive ignored.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Files whose tests start processes of their own (a training capture, rank processes, the demo); other tests that do
# say so with `pytestmark = pytest.mark.processes` or the `slow`, `sshd` and `slurm` marks.
_PROCESS_FILES = {"test_demo.py", "test_rank_processes.py"}
_HEAVY_MARKS = ("processes", "slow", "sshd", "slurm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the heavy tests by what they do (start processes, a capture, sshd, Slurm, or take long), so that
    `-m "not heavy"` gives a quick run. A test that only reads a session fixture's capture or replays on the session's
    warm runner is not heavy: the fixture is made once, whichever test asks first.

    The default run (scripts/test.sh) still runs every test; the marker only lets a person leave them out.
    """
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name == "capture" or path.name in _PROCESS_FILES:
            item.add_marker(pytest.mark.processes)
        if any(item.get_closest_marker(name) for name in _HEAVY_MARKS):
            item.add_marker(pytest.mark.heavy)


# Under pytest-xdist (scripts/test.sh: `-n 3 --dist loadgroup`) each worker is a test session of its own, with its own
# session fixtures. The tests that share a costly one go to one worker, so that it is made once: the Megatron-core
# checkpoints and captures (a few processes each), the loopback Slurm cluster (munged, slurmctld, slurmd).
_ONE_WORKER_FIXTURES = {
    "megatron_checkpoints": "megatron",
    "deepseek_checkpoints": "megatron",
    "slurm_cluster": "launches",  # with the launched replays (tests/remote/replay_launch_helpers.py)
}


# tryfirst: before pytest-xdist's own hook reads the xdist_group marks
@pytest.hookimpl(specname="pytest_collection_modifyitems", tryfirst=True)
def pytest_collection_modifyitems_worker_groups(items: list[pytest.Item]) -> None:
    """Give each test that must share a worker an `xdist_group` (`--dist loadgroup` runs a group on one worker):
    the tests of one costly session fixture (`_ONE_WORKER_FIXTURES`), and the tests of a module with a module-scoped
    fixture (made once per module, not once per worker). A test that names its group itself keeps it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        group = worker_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


_LOST_GROUP = pytest.StashKey[str]()


@pytest.hookimpl(specname="pytest_collection_modifyitems", trylast=True)
def pytest_collection_modifyitems_check_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fail a test of a `--dist loadgroup` run whose group is lost, saying why: pytest-xdist groups a test by the
    `@group` it appends to the test's node id, which pytest 9.2 no longer lets it do (pytest-xdist issue 1386;
    pyproject.toml pins pytest below 9.2). Run without its group, a test could meet another worker's processes."""
    if not getattr(config.option, "loadgroup", False):  # set on a pytest-xdist worker of --dist loadgroup
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            item.stash[_LOST_GROUP] = (
                f"pytest-xdist could not give this test its xdist_group under pytest {pytest.__version__}: use "
                "pytest below 9.2 (pyproject.toml), or run without -n"
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    lost = item.stash.get(_LOST_GROUP, None)
    if lost is not None:
        pytest.fail(lost, pytrace=False)


def worker_group(item: pytest.Item) -> str | None:
    """The worker group of a test (None: any worker, test by test)."""
    names = getattr(item, "fixturenames", ())
    for name, group in _ONE_WORKER_FIXTURES.items():
        if name in names:
            return group
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(chain and chain[-1].scope == "module" for chain in defs):
        return item.nodeid.split("::")[0]  # the module's tests, together
    return None


def _recorded_capture(factory: pytest.TempPathFactory, name: str, **options: Any) -> tuple[CaptureResult, Path]:
    """A reference run's CaptureResult (without final weights) recorded once per test run (`made_once`: one
    recording for every pytest-xdist worker), and its output dir."""
    from axrl_spike_replay.capture.reference.reference_trainer import CaptureResult, capture_reference_run

    def record(out: Path) -> dict[str, Any]:
        run = capture_reference_run(out, **options)
        return {
            **{k: str(getattr(run, k)) for k in ("output_dir", "log_path")},
            "snapshot_dirs": [str(p) for p in run.snapshot_dirs],
            **{k: getattr(run, k) for k in ("spike_iterations", "spike_ratios", "grad_norms", "config", "job_name")},
            "seconds": run.seconds,
        }

    logging.getLogger("axrl_spike_replay.guard").setLevel(logging.ERROR)
    out, doc = made_once(factory, name, record)
    paths = {k: Path(doc[k]) for k in ("output_dir", "log_path")}
    run = CaptureResult(**{**doc, **paths, "snapshot_dirs": [Path(p) for p in doc["snapshot_dirs"]]})
    return run, out


@pytest.fixture(scope="session")
def captured_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CaptureResult]:
    """CaptureResult of a reference run: world size 2, preset ratio_outliers, spikes at iterations 20-22.

    Shared by the whole run: read it, or copy its output dir before editing anything in it.
    """
    options = {"job": "demo-moe-grpo", "world_size": 2, "preset": "ratio_outliers", "seed": 0}
    run, out = _recorded_capture(tmp_path_factory, "captured-run", **options)
    check = left_as_recorded(out)
    yield run
    check()


@pytest.fixture(scope="session")
def negative_advantage_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CaptureResult]:
    """CaptureResult of a reference run: world size 1, seed 0, 32 steps, preset negative_advantage_dominance,
    spikes at iterations 20-22 (every advantage of the burst negative).

    Shared by the whole run: read it, or copy its output dir before editing anything in it.
    """
    options = {"preset": "negative_advantage_dominance", "seed": 0}
    run, out = _recorded_capture(tmp_path_factory, "negative-advantage-run", **options)
    check = left_as_recorded(out)
    yield run
    check()


@pytest.fixture(scope="session")
def hf_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A spike snapshot of the tiny qwen3_moe recorded with the trainer's own rank step (world size 2), for the
    transformers-model tests (tests/models/) and the MCP tools on it (tests/server/).

    Shared by the whole run (`made_once`): read it, or copy it before editing anything in it.
    """
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    root, snapshot = made_once(
        tmp_path_factory, "hf-qwen3-moe", lambda root: str(record_hf_snapshot(root, "qwen3_moe", world_size=2))
    )
    check = left_as_recorded(root)
    yield Path(snapshot)
    check()


@pytest.fixture(scope="session")
def warm_runner() -> Iterator[JobRunner]:
    """The session's warm replay processes (`WarmService.run_job`, as the MCP server runs replays), for the tests
    that check what a replay computes, not how its processes start: a pool stays up between tests, with the weights
    it loaded. A warm replay gives a cold one's numbers bit for bit (tests/server/test_warm_replay.py); the launcher
    tests (tests/test_rank_processes.py, tests/replay/test_killed_replay.py) start their own processes.
    """
    from axrl_spike_replay.replay.jobs.warm_pool import WarmService

    service = WarmService(memory_bytes=1 << 30)
    yield service.run_job
    service.close()


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
