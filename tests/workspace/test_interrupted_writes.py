"""A writer killed mid-write (SIGKILL during `method add` or `report`) leaves its temp file behind; the next write of
the same file removes it, and never the temp file of a writer that is still alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from record_helpers import JOB, SpikeRun, replay_result, save_result

from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.report import write_report
from axrl_spike_replay.workspace.task_record.task_log import record_replay

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "mcp_server"
BASE = 37.42

# A writer that stops inside fsync, its temp file written and not yet renamed, until it is killed.
STUCK_WRITER = """
import os, sys, time
from pathlib import Path
def stuck(fd):
    print("writing", flush=True)
    time.sleep(600)
os.fsync = stuck
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.report import write_report
workspace, what = Path(sys.argv[1]), sys.argv[2]
if what == "method":
    add_method(workspace, sys.argv[3], sys.argv[4], "clip-2", "clamps the outlier advantage")
else:
    write_report(workspace, sys.argv[3])
"""


@pytest.fixture
def investigated(tmp_path: Path, spike_run: SpikeRun) -> tuple[Path, str]:
    """A task with a baseline and one attempt that cleared the spike (its id)."""
    open_task(tmp_path, JOB, str(spike_run.snapshot))
    base = replay_result(spike_run.snapshot, BASE, "reproduced")
    record_replay(tmp_path, JOB, base, save_result(tmp_path, "base", base))
    clip = replay_result(spike_run.snapshot, 2.5, "cleared", mitigations={"advantage_clip": 2.0},
                         baseline_grad_norm=BASE, change_vs_baseline=2.5 / BASE - 1)  # fmt: skip
    attempt = record_replay(tmp_path, JOB, clip, save_result(tmp_path, "clip", clip))
    assert attempt is not None
    return tmp_path, attempt


@pytest.fixture
def writers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def stuck_writer(writers: list[subprocess.Popen[str]], *args: str) -> subprocess.Popen[str]:
    """A process writing `args` that is inside its write (temp file made, not renamed) when this returns."""
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)}
    process = subprocess.Popen([sys.executable, "-c", STUCK_WRITER, *args], env=env, stdout=subprocess.PIPE, text=True)
    writers.append(process)
    assert process.stdout is not None and process.stdout.readline() == "writing\n"
    return process


def killed(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def debris(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f".{name}.*.tmp"))


def test_a_method_file_killed_mid_write_leaves_nothing_after_the_next_write(
    investigated: tuple[Path, str], writers: list[subprocess.Popen[str]]
) -> None:
    workspace, attempt = investigated
    methods = workspace / "spike-mitigation-methods"
    killed(stuck_writer(writers, str(workspace), "method", JOB, attempt))
    assert len(debris(methods, "clip-2.md")) == 1 and not (methods / "clip-2.md").exists()

    add_method(workspace, JOB, attempt, "clip-2", "clamps the outlier advantage")
    assert debris(methods, "clip-2.md") == []
    assert "clamps the outlier advantage" in (methods / "clip-2.md").read_text()
    assert [p.name for p in methods.iterdir() if p.name.startswith(".")] == []


def test_a_report_killed_mid_write_leaves_nothing_after_the_next_report(
    investigated: tuple[Path, str], writers: list[subprocess.Popen[str]]
) -> None:
    workspace, _ = investigated
    killed(stuck_writer(writers, str(workspace), "report", JOB))
    (left,) = debris(workspace / "tmp" / "spike-replay" / JOB, "report.md")

    report = write_report(workspace, JOB)
    assert not left.exists() and debris(left.parent, "report.md") == []
    assert Path(report.path).read_text() == report.text


def test_the_temp_file_of_a_writer_still_alive_is_left_alone(
    investigated: tuple[Path, str], writers: list[subprocess.Popen[str]]
) -> None:
    workspace, _ = investigated
    alive = stuck_writer(writers, str(workspace), "report", JOB)
    folder = workspace / "tmp" / "spike-replay" / JOB
    (theirs,) = debris(folder, "report.md")
    write_report(workspace, JOB)  # a second writer of the same file meanwhile
    assert theirs.exists()  # locked by its living writer: not debris
    killed(alive)
    write_report(workspace, JOB)
    assert debris(folder, "report.md") == []
