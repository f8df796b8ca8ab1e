"""Atomic writes: a reader sees the old file or the complete new one, never a half-written one.

The temp file gets the mode a plain `open()` would have given the file (0666 less the umask, or the
existing file's mode), not mkstemp's 0600: teammates on shared storage must be able to read results.
A copy of a file is the exception: it is never more readable than its source (`copy_mode`), whatever
the umask or a file it replaces would allow.
"""

from __future__ import annotations

import errno
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


def copy_mode(source_mode: int) -> int:
    """The permission bits of a copy of a file whose `st_mode` is `source_mode`: the source's own permission
    bits less the umask (set-id and sticky bits dropped). A 0600 source gives a 0600 copy under any umask."""
    return stat.S_IMODE(source_mode) & 0o777 & ~current_umask()


def temp_beside(target: Path, suffix: str = ".tmp", mode: int | None = None) -> tuple[int, Path]:
    """A temp file next to `target` (same filesystem, so rename is atomic) with `mode`, by default the plain-open
    mode. It is created 0600 and only then given its mode, so it is never wider than that."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.fchmod(fd, plain_open_mode(target) if mode is None else mode)
    return fd, Path(tmp)


def copy_bytes(source: int, out: int, size: int | None = None) -> int:
    """Copy from the open file `source` (from its offset 0, leaving its position alone) to `out`: in the kernel
    where it can (`sendfile`), else through a buffer. `size`: at most this many bytes (default: to the end)."""
    done, chunk = 0, 64 << 20
    while size is None or done < size:
        count = chunk if size is None else min(chunk, size - done)
        try:
            sent = os.sendfile(out, source, done, count)
        except OSError:  # no sendfile between these files: through a buffer, at explicit offsets too
            sent = os.write(out, os.pread(source, min(count, 1 << 20), done))
        if sent == 0:
            break
        done += sent
    return done


def atomic_copy(source: str | os.PathLike[str], target: str | os.PathLike[str], *, keep_times: bool = False) -> Path:
    """Copy file `source` to `target` through a temp file beside it, renamed over `target` once whole (a symlink
    there is replaced, never written through). The copy gets `copy_mode` of the source, read from the file
    opened, so it is never more readable than the source; `keep_times` also keeps its access and modification times."""
    target_path = Path(target)
    with open(source, "rb") as src:
        info = os.fstat(src.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(source))
        fd, tmp = temp_beside(target_path, suffix=".part", mode=copy_mode(info.st_mode))
        try:
            with os.fdopen(fd, "wb") as out:
                copy_bytes(src.fileno(), out.fileno())
            if keep_times:
                os.utime(tmp, ns=(info.st_atime_ns, info.st_mtime_ns))
            os.replace(tmp, target_path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return target_path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int | None = None) -> Path:
    """Write `data` to `path` through a temp file in the same directory, fsync and rename. `mode`: the file's
    permission bits (default: what a plain `open()` would give it)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(target, mode=mode)
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


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int | None = None) -> Path:
    """Write UTF-8 text atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: str | os.PathLike[str], payload: Any, mode: int | None = None) -> Path:
    """Write JSON (indented, trailing newline) atomically."""
    return atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n", mode)
