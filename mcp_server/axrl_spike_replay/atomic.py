"""Atomic writes: a reader sees the old file or the complete new one, never a half-written one.

The temp file gets the mode a plain `open()` would have given the file (0666 less the umask, or the
existing file's mode), not mkstemp's 0600: teammates on shared storage must be able to read results.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask is process-global)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_open_mode(target: Path) -> int:
    """The permission bits `open(target, "w")` would leave: the existing file's, else 0666 & ~umask."""
    try:
        info = os.stat(target, follow_symlinks=False)
        if stat.S_ISREG(info.st_mode):
            return stat.S_IMODE(info.st_mode)
    except OSError:
        pass
    return 0o666 & ~current_umask()


def temp_beside(target: Path, suffix: str = ".tmp") -> tuple[int, Path]:
    """A temp file next to `target` (same filesystem, so rename is atomic) with the plain-open mode."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.fchmod(fd, plain_open_mode(target))
    return fd, Path(tmp)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` through a temp file in the same directory, fsync and rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 text atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], payload: Any) -> Path:
    """Write JSON (indented, trailing newline) atomically."""
    return atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
