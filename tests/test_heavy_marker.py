"""`-m "not heavy"` is the quick run: the files that train a capture or start rank processes on their own (the demo,
the rank launcher) are left out of it whole."""

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
