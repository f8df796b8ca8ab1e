"""Copying a job's logs into the workspace while they are scanned.

Each log is opened once. A thread copies its first N bytes (its size when opened) file to file in the kernel
(`sendfile` at explicit offsets, which leaves the scan's read position alone) while the scan reads the same N
bytes from the same open file: the copy and the scan see the same bytes, a line appended meanwhile is in
neither, and the copy's time is hidden behind the scan's on a second core. The copy goes through a temp file
renamed over the target (a symlink at the target is replaced, never written through) only once it is whole.
The copy is never more readable than the log, from its first byte on: it gets the log's permission bits less the
umask, its group bits dropped to what others may do where its group is not the log's, as in a setgid workspace
(`atomic.copy_mode`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.files.atomic import temp_beside
from axrl_spike_replay.untrusted.containment import inside_of, is_inside, resolved_text

_COPY_BYTES = 64 * 1024 * 1024  # per sendfile call: the copy checks for cancellation between them
_BUFFER_BYTES = 1024 * 1024
INLINE_COPY_BYTES = 1 << 20  # a smaller log is copied before its scan, without a thread


@dataclass(frozen=True)
class PlannedCopy:
    """A log and where its copy goes; `in_place` when the target is the log itself (nothing to copy)."""

    source: Path
    target: Path
    in_place: bool


def plan_copies(
    files: list[tuple[Path, Path]], dest: Path, root: Path
) -> tuple[list[PlannedCopy], list[dict[str, str]]]:
    """Where each (log, path relative to `dest`) is copied, folders made; entries whose folder leads out of
    `dest` are skipped, with the reason. A copy dir that resolves outside `root` is refused."""
    if not is_inside(dest, root):
        raise AxrlError(
            f"log copy dir {dest} leads outside {root} (to {resolved_text(dest)}) through a symlink; "
            "refusing to write there"
        )
    dest.mkdir(parents=True, exist_ok=True)
    planned: list[PlannedCopy] = []
    taken: set[Path] = set()
    skipped: list[dict[str, str]] = []
    within_dest = inside_of(dest)
    for source, rel in files:
        target = dest / rel
        stem, n = target, 2
        while target in taken:
            target = stem.with_name(f"{stem.stem}-{n}{stem.suffix}")
            n += 1
        if not within_dest(target.parent):
            skipped.append(
                {"path": str(source), "reason": f"its copy's folder {target.parent} leads outside {dest}; not copied"}
            )
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        # a log already in place (dest holds the originals) is scanned as it is
        same = target.is_file() and not target.is_symlink() and target.samefile(source)
        planned.append(PlannedCopy(source, target, same))
        taken.add(target)
    return planned, skipped


def _check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise AxrlError(f"log scan cancelled {where}")


class CopyBeside(threading.Thread):
    """Copies the first `size` bytes of the open `handle` to `target` (through a temp file) in a thread (`begin`);
    `end` stops it early, leaving no file. `finish` waits and raises what went wrong (AxrlError)."""

    def __init__(self, handle: BinaryIO, source: Path, target: Path, size: int, cancel: threading.Event | None):
        super().__init__(name=f"copy {target.name}", daemon=True)
        self.handle, self.source, self.target, self.size, self.cancel = handle, source, target, size, cancel
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.source_stat = os.fstat(handle.fileno())  # of the file opened: the one the copy holds

    def run(self) -> None:
        fd, tmp = temp_beside(self.target, copy_of=self.source_stat)
        try:
            with os.fdopen(fd, "wb") as out:
                self._copy(out.fileno())
                if self.stopped.is_set():
                    raise AxrlError(f"copy of {self.source} stopped")
                os.replace(tmp, self.target)  # no fsync: the copy can be made again; renamed while still locked
        except BaseException as exc:  # handed to `finish`, in the scanning thread
            tmp.unlink(missing_ok=True)
            self.error = exc

    def _copy(self, out: int) -> None:
        done, source = 0, self.handle.fileno()
        while done < self.size and not self.stopped.is_set():
            _check_cancel(self.cancel, f"while copying {self.source}")
            count = min(_COPY_BYTES, self.size - done)
            try:
                sent = os.sendfile(out, source, done, count)
            except OSError:  # no sendfile between these files: through a buffer, at explicit offsets too
                sent = os.write(out, os.pread(source, min(count, _BUFFER_BYTES), done))
            if sent == 0:  # the file got shorter meanwhile: the copy holds what there was
                break
            done += sent

    def begin(self) -> None:
        """Start the copy: in the thread, or, for a log of at most `INLINE_COPY_BYTES`, here and now (a thread
        costs more than such a copy, and a job's logs dir may hold tens of thousands of small files)."""
        if self.size <= INLINE_COPY_BYTES:
            self.run()
        else:
            self.start()

    def end(self) -> None:
        """Stop the copy early (no file is left) and wait for it."""
        self.stopped.set()
        if self.ident is not None:
            self.join()

    def finish(self) -> None:
        """Wait for the copy; raise what stopped it."""
        if self.ident is not None:
            self.join()
        if isinstance(self.error, OSError):
            raise AxrlError(f"{self.error.filename or self.target}: cannot copy the logs ({self.error.strerror})")
        if self.error is not None:
            raise self.error
