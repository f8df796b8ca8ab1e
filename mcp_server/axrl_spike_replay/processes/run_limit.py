"""A run's time limit, as its cancel flag: `time_limited` hands the job runners a flag that is set when the caller
cancels or when `timeout_s` has passed, so every place that already stops on cancel (between configs, layers and
micro-batches in this process; the launcher's poll of its rank processes; a warm pool's ranks) stops on the limit
too, and the RunCancelled it raises is said again naming the limit. Nothing is written by the limit itself: the
caller records its failed result as it does a cancelled one's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from axrl_spike_replay.processes.rank_processes import RunCancelled


class RunLimit(threading.Event):
    """Set when it is set here, when `cancel` is, or once `timeout_s` has passed since it was made (None: never)."""

    def __init__(self, cancel: threading.Event | None, timeout_s: float | None) -> None:
        super().__init__()
        self.cancel, self.timeout_s = cancel, timeout_s
        self.until = None if timeout_s is None else time.monotonic() + timeout_s

    @property
    def passed(self) -> bool:
        """Whether the time limit has passed."""
        return self.until is not None and time.monotonic() > self.until

    def is_set(self) -> bool:
        return super().is_set() or (self.cancel is not None and self.cancel.is_set()) or self.passed


@contextmanager
def time_limited(cancel: threading.Event | None, timeout_s: float | None, what: str = "run") -> Iterator[RunLimit]:
    """The flag to hand a job runner for `cancel` and `timeout_s` (None: `cancel` alone); a RunCancelled raised
    inside after the limit passed (and not cancelled by the caller) is raised again as `<what> timed out after N s`."""
    limit = RunLimit(cancel, timeout_s)
    try:
        yield limit
    except RunCancelled as exc:
        if limit.passed and not (cancel is not None and cancel.is_set()):
            raise RunCancelled(f"{what} timed out after {timeout_s:g} s (`timeout_s`); its work was stopped") from exc
        raise
