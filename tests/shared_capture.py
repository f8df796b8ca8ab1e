"""A capture shared by the test session is read-only to tests: a check that it is still as it was recorded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


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
