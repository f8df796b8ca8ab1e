"""Inter-process locks on lock files beside what they guard, with clear errors instead of tracebacks."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

from filelock import FileLock, Timeout

from axrl_spike_replay.errors import AxrlError


@contextmanager
def held_lock(path: str | os.PathLike[str], timeout: float, what: str) -> Iterator[None]:
    """Hold the lock file `path` for `what`; AxrlError naming it on a timeout, a symlink or an unusable file.

    filelock opens with O_NOFOLLOW, so a lock file replaced by a symlink is never written through; this
    turns that (and permission or timeout failures) into a message instead of a traceback.
    """
    lock_path = os.fspath(path)
    if os.path.islink(lock_path):
        raise AxrlError(f"lock file {lock_path} ({what}) is a symlink; remove it (nothing is written through it)")
    try:
        lock = FileLock(lock_path, timeout=timeout)
        lock.acquire()
    except Timeout:
        raise AxrlError(f"{what}: could not lock {lock_path} within {timeout:.0f}s (held elsewhere)") from None
    except OSError as exc:
        reason = "it is a symlink" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise AxrlError(f"{what}: cannot use lock file {lock_path}: {reason}") from None
    try:
        yield
    finally:
        lock.release()
