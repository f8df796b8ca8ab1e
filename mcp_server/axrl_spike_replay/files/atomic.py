"""Atomic writes: a reader sees the old file or the complete new one, never a half-written one.

The temp file gets the mode a plain `open()` would have given the file (0666 less the umask, or the
existing file's mode), not mkstemp's 0600: teammates on shared storage must be able to read results.
A copy of a file is the exception: it is never more readable than its source (`copy_mode`), whatever
the umask, the group a setgid directory gives it or a file it replaces would allow.

A writer killed mid-write (SIGKILL, OOM, a node lost) leaves its temp file `.<name>.XXXXXXXX.tmp` behind.
Each temp file is locked (`flock`) by its writer for as long as it is open, so the next atomic write of
the same file tells a dead writer's debris (unlocked) from a live writer's temp (locked) and removes the
debris first (`sweep_debris`): nothing half-written stays beside a method file, a report or a result.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

TEMP_SUFFIXES = (".tmp", ".part")
_MKSTEMP_NAME = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")  # tempfile's random names: 8 of these
_UNLOCKED_GRACE_S = 10.0  # an empty temp file this young may belong to a writer between creating and locking it


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


def copy_mode(source_mode: int, *, same_group: bool = True) -> int:
    """The permission bits of a copy of a file whose `st_mode` is `source_mode`, less the umask (set-id and sticky
    bits dropped): nobody may read or write the copy who could not do so to the source. The copy's owner (the
    copier, who read the source) keeps the source's owner bits. Anyone who reads the copy by its group or other
    bits may be, for the source, its owner, a member of its group or neither, so those bits are the ones every such
    class has on the source: its other bits at most its group bits, and when the copy's group is not the source's
    (`same_group` False: a setgid directory, a node's file of another group id) its group bits at most its other
    bits. A 0600 source gives a 0600 copy under any umask; a 0640 one 0600 where the group changes."""
    bits = stat.S_IMODE(source_mode) & 0o777
    owner, group, other = bits >> 6, (bits >> 3) & 7, bits & 7
    group &= owner if same_group else owner & other
    other &= owner & group
    return ((owner << 6) | (group << 3) | other) & ~current_umask()


def temp_beside(
    target: Path,
    suffix: str = ".tmp",
    mode: int | None = None,
    *,
    sweep: bool = False,
    copy_of: os.stat_result | None = None,
) -> tuple[int, Path]:
    """A temp file next to `target` (same filesystem, so rename is atomic) with `mode`, by default the plain-open
    mode; `copy_of`: the mode of a copy of the file so stat'ed (`copy_mode`, judged against the group the temp file
    got: a setgid directory gives its own). It is created 0600 and only then given its mode, so it is never wider
    than that. It is locked by this writer while its descriptor is open (keep it open until the rename). `sweep`:
    first remove the temp files killed writers left beside `target` (`sweep_debris`)."""
    if sweep:
        sweep_debris(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    with contextlib.suppress(OSError):  # no locks on this filesystem: the sweep cannot tell, so leaves it alone
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if copy_of is not None:
        mode = copy_mode(copy_of.st_mode, same_group=os.fstat(fd).st_gid == copy_of.st_gid)
    os.fchmod(fd, plain_open_mode(target) if mode is None else mode)
    return fd, Path(tmp)


def sweep_debris(target: Path) -> int:
    """Remove the temp files (`.<name>.XXXXXXXX.tmp` / `.part`) that writers of `target` left when they were
    killed: those no live writer holds locked. How many were removed; never raises."""
    prefix = f".{target.name}."
    removed = 0
    try:
        entries = os.scandir(target.parent)
    except OSError:
        return 0
    with entries:
        for entry in entries:
            name = entry.name
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            suffix = next((s for s in TEMP_SUFFIXES if rest.endswith(s)), None)
            if suffix is None or len(rest) != 8 + len(suffix) or not _MKSTEMP_NAME.issuperset(rest[:8]):
                continue
            removed += _remove_if_abandoned(entry.path)
    return removed


def _remove_if_abandoned(path: str) -> bool:
    """Unlink `path` when it is a regular file nobody holds locked (its writer is gone), checked under our lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        if info.st_size == 0 and time.time() - info.st_mtime < _UNLOCKED_GRACE_S:
            return False  # maybe a writer that has created it and not locked it yet
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live writer holds it (or this filesystem has no locks: cannot tell)
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


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
        fd, tmp = temp_beside(target_path, suffix=".part", copy_of=info, sweep=True)
        try:
            with os.fdopen(fd, "wb") as out:
                copy_bytes(src.fileno(), out.fileno())
                if keep_times:
                    os.utime(tmp, ns=(info.st_atime_ns, info.st_mtime_ns))
                os.replace(tmp, target_path)  # still open, so still locked: a sweep never takes it for debris
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return target_path


def atomic_write_bytes(
    path: str | os.PathLike[str], data: bytes, mode: int | None = None, *, copy_of: os.stat_result | None = None
) -> Path:
    """Write `data` to `path` through a temp file in the same directory, fsync and rename. `mode`: the file's
    permission bits (default: what a plain `open()` would give it); `copy_of`: `data` comes from the file so
    stat'ed, and the file is no more readable than it (`copy_mode`). Temp files left beside `path` by writers that
    were killed are removed first."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(target, mode=mode, sweep=True, copy_of=copy_of)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
            os.replace(tmp, target)  # still open, so still locked: a sweep never takes it for debris
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(
    path: str | os.PathLike[str], text: str, mode: int | None = None, *, copy_of: os.stat_result | None = None
) -> Path:
    """Write UTF-8 text atomically (`mode`, `copy_of`: as `atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode, copy_of=copy_of)


def atomic_write_json(
    path: str | os.PathLike[str], payload: Any, mode: int | None = None, *, copy_of: os.stat_result | None = None
) -> Path:
    """Write JSON (indented, trailing newline) atomically (`mode`, `copy_of`: as `atomic_write_bytes`)."""
    text = json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n"
    return atomic_write_text(path, text, mode, copy_of=copy_of)
