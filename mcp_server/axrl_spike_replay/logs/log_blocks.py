"""A log read as blocks of whole lines, into one buffer kept for the whole file.

Each block is b"\\n" + whole lines, newlines made universal (\\r\\n and \\r read as \\n, as text mode reads
them), in file order; a line too long to hold is given apart as its head. The buffer is filled in place
(`readinto`) and the part of a line left at a block's end moved to its front: no new memory per read (fresh
memory for every megabyte costs more than the scan of it), and memory flat in the file size.

A block is the buffer itself and the block's end in it: it is valid until the next block is asked for, so a
reader copies what it keeps.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from axrl_spike_replay.errors import AxrlError

# A training log line is at most a few KB; longer ones are skipped (only their start is checked for errors).
MAX_LINE_CHARS = 64 * 1024
READ_BYTES = 2 * 1024 * 1024
# A line of more than this many bytes has more than MAX_LINE_CHARS characters (a character is 1 to 4 bytes).
HEAD_BYTES = 4 * (MAX_LINE_CHARS + 2)
_LONG = re.compile(rb"\n[^\n]{%d}" % (MAX_LINE_CHARS + 1))
_CR, _NEWLINE = 13, 10


class ByteSource(Protocol):
    """What a log is read from: an open binary file, or any reader of its bytes in order."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...


def check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise AxrlError(f"log scan cancelled {where}")


Block = tuple[str, bytes | bytearray, int]  # ("lines" | "long", data, end): the block is data[:end]


class LineBlocks:
    """The blocks of a log from `source` (at most `limit` bytes). `where()` names the place for a cancellation
    message; `cancel` is checked before every read."""

    def __init__(
        self, source: ByteSource, cancel: threading.Event | None, where: Callable[[], str], limit: int | None
    ) -> None:
        self.source, self.cancel, self.where = source, cancel, where
        self.left = limit  # bytes still to read (None: to the end of the file)
        # what is held (a line's head, or a partial line of up to one read) + one read + one byte that keeps a
        # \r\n pair whole; no more than the log needs (a small log is read often, e.g. to check one iteration)
        read = READ_BYTES if limit is None else min(READ_BYTES, limit)
        self.buffer = bytearray(2 * read + (HEAD_BYTES if limit is None else min(HEAD_BYTES, limit)) + 4)
        self.view = memoryview(self.buffer)

    def _take(self, at: int, size: int) -> int:
        """Read up to `size` bytes into the buffer at `at`; how many were read."""
        size = size if self.left is None else min(size, self.left)
        if at + size > len(self.buffer):  # never: what is held plus a read always fits (see __init__)
            raise AxrlError(f"log reading buffer of {len(self.buffer)} bytes cannot take {size} more at {at}")
        read = (self.source.readinto(self.view[at : at + size]) or 0) if size else 0
        if self.left is not None:
            self.left -= read
        return read

    def _fill(self, held: int) -> int:
        """Read after the `held` bytes at the buffer's front, newlines made universal; where the bytes end."""
        check_cancel(self.cancel, self.where())
        end = held + self._take(held, READ_BYTES)
        if end > held and self.buffer.find(b"\r", held, end) >= 0:
            while self.buffer[end - 1] == _CR and self._take(end, 1):  # keep a \r\n pair in one read
                end += 1
            universal = bytes(self.view[held:end]).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            self.buffer[held : held + len(universal)] = universal
            end = held + len(universal)
        return end

    def __iter__(self) -> Iterator[Block]:
        buffer = self.buffer
        buffer[0] = _NEWLINE  # the newline that opens the next line, then what has been read of that line
        held = 1
        while (end := self._fill(held)) > held:
            cut = buffer.rfind(b"\n", 0, end)
            if cut > 0:
                yield from _split_long(buffer, cut + 1)
                held = end - cut
                buffer[:held] = bytes(self.view[cut:end])
            elif end > HEAD_BYTES:  # a line too long to hold: keep its head, read past the rest
                head = bytes(self.view[1 : HEAD_BYTES + 1])
                closed, rest = self._past_line()
                line = head + b"\n" if closed else head
                yield "long", line, len(line)
                held = 1 + len(rest)
                buffer[0] = _NEWLINE
                buffer[1:held] = rest
            else:
                held = end
        if held > 1:
            last = bytes(self.view[:held])
            yield from _split_long(last, len(last))

    def _past_line(self) -> tuple[bool, bytes]:
        """Read to the end of the current line: (whether a newline ended it, what follows it in the read)."""
        while (end := self._fill(0)) > 0:
            newline = self.buffer.find(b"\n", 0, end)
            if newline >= 0:
                return True, bytes(self.view[newline + 1 : end])
        return False, b""


def _split_long(data: bytes | bytearray, stop: int) -> Iterator[Block]:
    """data[:stop] (b"\\n" + lines) as blocks of lines of at most MAX_LINE_CHARS bytes, and the longer lines."""
    start = 0  # data[start] is the b"\\n" that opens the next block
    # a line longer than 2 * step holds a whole aligned step of bytes without a newline: cheap to rule out
    step = MAX_LINE_CHARS // 2
    if all(data.find(b"\n", at, at + step) >= 0 for at in range(0, stop - step, step)):
        yield "lines", data, stop
        return
    for match in _LONG.finditer(data, 0, stop):
        if match.start() > start:
            yield _whole("lines", data[start : match.start() + 1])
        end = data.find(b"\n", match.end(), stop)
        if end < 0:
            yield _whole("long", data[match.start() + 1 : stop])
            return
        yield _whole("long", data[match.start() + 1 : end + 1])
        start = end
    if start < stop - 1:
        yield _whole("lines", data[start:stop])


def _whole(kind: str, data: bytes | bytearray) -> Block:
    data = bytes(data)
    return kind, data, len(data)
