"""`-m "not heavy"` is the quick run: a test is heavy by what it does (starts processes, sshd, Slurm, or takes long),
not by the fixtures it reads. The files that train a capture or start rank processes on their own (the demo, the rank
launcher) are left out of it whole; a test that reads the session's shared capture stays in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _selected(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode in (0, 5), out.stdout + out.stderr  # 5: every test deselected
    return [line for line in out.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # two pytest collections in subprocesses
def test_the_quick_run_leaves_out_the_demo_and_the_rank_launcher() -> None:
    files = ["tests/test_demo.py", "tests/test_rank_processes.py"]
    everything = _selected(*files)
    assert {line.split("::")[0] for line in everything} == set(files)  # both files hold tests ...
    assert _selected("-m", "not heavy", *files) == []  # ... and the quick run selects none of them


@pytest.mark.slow  # a pytest collection in a subprocess
def test_a_test_that_reads_the_shared_capture_stays_in_the_quick_run() -> None:
    test = "test_a_log_prob_mismatch_spike_is_diagnosed_as_such_with_the_carrying_sample"
    reads = f"tests/analysis/test_diagnose.py::{test}"
    trains = "tests/capture/test_reference_trainer.py"
    assert _selected("-m", "not heavy", reads) == [reads]  # it uses `captured_run`, made once by whoever asks first
    assert _selected("-m", "not heavy", trains) == []  # the capture tests train their own
