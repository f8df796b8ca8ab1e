"""A capture shared by the test session is read-only to tests: a check that it is still as it was recorded, and
one recording for every pytest-xdist worker of a run."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def _tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under `root`, by relative path."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def left_as_recorded(root: Path) -> Callable[[], None]:
    """A check, run at the session's end, that no test wrote into, added to or removed from the capture at `root`."""
    recorded = _tree_state(root)

    def check() -> None:
        now = _tree_state(root)
        changed = sorted(name for name in recorded.keys() | now.keys() if recorded.get(name) != now.get(name))
        assert not changed, f"a test changed the shared capture {root} (copy it before editing): {changed[:10]}"

    return check


def made_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> tuple[Path, Any]:
    """(root, document): `make(root)` run once per test run, its JSON document kept beside `root`. Under
    pytest-xdist, the first worker to ask makes it in the run's temp dir, which every worker shares, while the
    others wait on a lock; then each reads the same root and document (what the recording wrote is read-only to
    tests, as within one worker). Without xdist, a temp dir of this session's own."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        root = factory.mktemp(name)
        return root, json.loads(json.dumps(make(root)))
    shared = factory.getbasetemp().parent  # the run's temp dir, above each worker's own (`popen-gwN`)
    root, done = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # what a worker that failed making it left
            root.mkdir()
            document = make(root)
            done.write_text(json.dumps(document))
        return root, json.loads(done.read_text())
