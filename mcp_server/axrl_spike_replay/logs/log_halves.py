"""Scanning a large log on two cores: the second half in a forked process, the first half here.

The file is cut right after a newline near its middle, so no line (nor a \\r\\n pair) spans the cut; each half
is read as the whole file would read it, and the second half's tally is added after the first's, its line
numbers shifted by the first half's lines: the same series, errors and counts as one reading.

A fork is safe only where this process runs no other thread (a lock held by another thread at the fork stays
held in the child), so the halves are scanned apart only then: the CLI, not a server with worker threads. The
child reads with `pread` from its own offsets (the open file's position is shared with this process), dies
with its parent, and is killed when the scan here fails or is cancelled.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import BinaryIO

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.logs.log_reader import MAX_ERRORS, LogTally, scan_handle
from axrl_spike_replay.processes.process_starts import die_with_launcher

SPLIT_BYTES = 64 * 1024 * 1024  # a smaller log is scanned whole: a fork and a merge cost more than half of it
_CUT_WINDOW = 1024 * 1024  # a newline is looked for this far past the middle; none: the log is scanned whole
_POLL_S = 0.05


class _PositionalReader:
    """`readinto` of a file from a given offset (`preadv`): this process's own position, not the open file's."""

    def __init__(self, fd: int, start: int) -> None:
        self.fd, self.at = fd, start

    def readinto(self, buffer: memoryview, /) -> int:
        read = os.preadv(self.fd, [buffer], self.at)
        self.at += read
        return read


def cut_point(fd: int, size: int) -> int | None:
    """Just after the first newline at or past the middle of the first `size` bytes; None when the log is
    too small to split or has no newline near its middle."""
    if size < SPLIT_BYTES:
        return None
    middle = size // 2
    window = os.pread(fd, min(_CUT_WINDOW, size - middle), middle)
    newline = window.find(b"\n")
    return None if newline < 0 or middle + newline + 1 >= size else middle + newline + 1


def can_fork() -> bool:
    """Whether this process may fork to scan (Linux, and no other thread running here)."""
    return hasattr(os, "fork") and threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()


def _scan_second_half(fd: int, start: int, size: int, path: Path, results: Connection) -> None:
    die_with_launcher()
    tally = LogTally()
    try:
        scan_handle(_PositionalReader(fd, start), path, tally, limit=size - start)
    except BaseException as exc:  # told to the parent, which raises it
        results.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    results.send(("tally", tally))


class SecondHalf:
    """The scan of the bytes [start, size) of an open log in a forked process."""

    def __init__(self, handle: BinaryIO, start: int, size: int, path: Path) -> None:
        context = multiprocessing.get_context("fork")
        self._results, sending = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_scan_second_half,
            args=(handle.fileno(), start, size, path, sending),
            name=f"scan {path.name} from byte {start}",
            daemon=True,
        )
        self._process.start()
        sending.close()
        self.path = path

    def stop(self) -> None:
        """Kill the scan (the scan here failed or was cancelled)."""
        self._process.kill()
        self._process.join()
        self._results.close()

    def add_to(self, tally: LogTally, cancel: threading.Event | None) -> None:
        """Wait for the second half and add it to `tally` (which holds the first); `cancel` kills it."""
        try:
            while not self._results.poll(_POLL_S):
                if cancel is not None and cancel.is_set():
                    raise AxrlError(f"log scan cancelled in {self.path.name} at line {tally.lines + 1}")
                if not self._process.is_alive() and not self._results.poll():
                    raise AxrlError(f"{self.path}: the scan of its second half ended without a result")
            kind, payload = self._results.recv()
        except BaseException:
            self.stop()
            raise
        self._process.join()
        self._results.close()
        if kind == "error":
            raise AxrlError(f"{self.path}: scanning its second half failed ({payload})")
        _add_later(tally, payload)


def _add_later(tally: LogTally, later: LogTally) -> None:
    """`later` (the lines after those of `tally`, numbered from 1) added to `tally`."""
    room = MAX_ERRORS - len(tally.errors)
    tally.errors += [{**error, "line": error["line"] + tally.lines} for error in later.errors[: max(room, 0)]]
    tally.error_lines += later.error_lines
    tally.long_lines += later.long_lines
    tally.lines += later.lines
    tally.series.extend_builder(later.series)
