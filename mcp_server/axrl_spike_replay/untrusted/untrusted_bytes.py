"""Bytes from files we did not write: bounded reads of regular files, UTF-8 decoding with a short reason.

Errors are `UntrustedInputError` (a ValueError) whose message says why without the file name; callers
prefix the name and choose their own error class.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path


class UntrustedInputError(ValueError):
    """Input that is not usable: the message says why, without the file name."""


def read_bounded(path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = True) -> bytes:
    """At most `limit` bytes of a regular file; UntrustedInputError when larger or not a regular file.

    Without `follow_symlinks` a symlink is refused (O_NOFOLLOW); a FIFO is never waited on (O_NONBLOCK).
    OSError (missing, unreadable) passes through for the caller to word.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(Path(path), flags)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedInputError("is not a regular file")
        if info.st_size > limit:
            raise UntrustedInputError(f"is {info.st_size} bytes, more than the {limit}-byte limit")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UntrustedInputError(f"is more than the {limit}-byte limit")
    return data


def file_kind(mode: int) -> str:
    """What a file of `mode` (st_mode) is, in words: "a regular file", "a FIFO (named pipe)", ..."""
    for test, words in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return words
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> io.BufferedReader:
    """`path` opened for binary reading when it is a regular file (symlinks followed); UntrustedInputError
    saying what it is otherwise. Opened with O_NONBLOCK, so a FIFO (or a device) is never waited on, even one
    put in place of a file checked before. OSError (missing, unreadable) passes through."""
    fd = os.open(Path(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UntrustedInputError(f"is {file_kind(mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # no effect on a regular file's reads; restored for tidiness
    except BaseException:
        os.close(fd)
        raise
    return open(fd, "rb")  # the caller closes it


def utf8_text(data: bytes) -> str:
    """`data` as UTF-8 text; UntrustedInputError saying where it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UntrustedInputError(f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
