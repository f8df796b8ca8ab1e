"""Bytes from files we did not write: bounded reads of regular files, UTF-8 decoding with a short reason.

Errors are `UntrustedInputError` (a ValueError) whose message says why without the file name; callers
prefix the name and choose their own error class.
"""

from __future__ import annotations

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


def utf8_text(data: bytes) -> str:
    """`data` as UTF-8 text; UntrustedInputError saying where it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UntrustedInputError(f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
