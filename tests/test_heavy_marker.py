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


FILES = ["tests/test_demo.py", "tests/test_rank_processes.py"]  # they train a capture or start rank processes
READS = "tests/analysis/test_diagnose.py::test_a_log_prob_mismatch_spike_is_diagnosed_as_such_with_the_carrying_sample"
TRAINS = "tests/capture/test_reference_trainer.py"


@pytest.fixture(scope="module")
def collected() -> dict[str, list[str]]:
    """Two pytest collections in subprocesses, read by both tests: the whole of FILES, and the quick run of FILES,
    READS and TRAINS together (the mark selects test by test: one collection answers for each of them)."""
    return {"all": _selected(*FILES), "quick": _selected("-m", "not heavy", *FILES, READS, TRAINS)}


def _from(lines: list[str], where: str) -> list[str]:
    return [line for line in lines if line == where or line.startswith(f"{where}::")]


@pytest.mark.slow  # pytest collections in subprocesses
def test_the_quick_run_leaves_out_the_demo_and_the_rank_launcher(collected: dict[str, list[str]]) -> None:
    assert {line.split("::")[0] for line in collected["all"]} == set(FILES)  # both files hold tests ...
    assert [line for f in FILES for line in _from(collected["quick"], f)] == []  # ... and the quick run selects none


@pytest.mark.slow  # pytest collections in subprocesses
def test_a_test_that_reads_the_shared_capture_stays_in_the_quick_run(collected: dict[str, list[str]]) -> None:
    assert _from(collected["quick"], READS) == [READS]  # it uses `captured_run`, made once by whoever asks first
    assert _from(collected["quick"], TRAINS) == []  # the capture tests train their own
    assert sorted(collected["quick"]) == [READS]  # and nothing else was selected
