"""A node's read speed, timed on a bounded region of one file dropped from the page cache first: the snapshot's
largest checkpoint data file (`checkpoint_data_file`), or, where a node holds no copy of the snapshot, a temporary
file written on its replay disk for the purpose (`measure_scratch_read`: written, fsync'd, dropped, read, removed).

The region is first dropped from the page cache (its dirty pages written, then `posix_fadvise` DONTNEED, which any
reader of a file may ask); what the kernel still holds of it just before the read (`mincore` on a map of the region:
a tmpfs, say) is said: above half, the read was from the page cache, so the speed is memory's, not the disk's.
Nothing here imports torch: a node whose speeds are kept is asked only this much.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

READ_BYTES = 256 << 20
SCRATCH_BYTES = 64 << 20  # the temporary file's size where the node holds no copy of the snapshot
CHUNK = 8 << 20
SCRATCH_PREFIX = "axrl-read-speed-"
_DATA_FILES = ("*.distcp", "*.safetensors", "model_world_size_*_rank_*.pt")


@dataclass(frozen=True)
class ReadSpeed:
    """One timed read: bytes, seconds, of which file, and the fraction of it resident beforehand (None: unknown)."""

    bytes_read: int
    seconds: float
    file: str
    resident: float | None

    @property
    def cached(self) -> bool | None:
        """Whether the read came from the page cache (more than half the region resident before it)."""
        return None if self.resident is None else self.resident > 0.5

    @property
    def where(self) -> str:
        """Disk or page cache, in words."""
        if self.cached is None:
            return "page cache unknown"
        return "from the page cache: memory's speed, not the disk's" if self.cached else "from disk"


def checkpoint_data_file(weights_dir: Path) -> Path | None:
    """The largest data file of the checkpoint in `weights_dir` (DCP, safetensors, verl shards); None: none there.
    A symlink is never one: the probe reads only the snapshot's own files."""
    files = [f for pattern in _DATA_FILES for f in weights_dir.glob(pattern) if f.is_file() and not f.is_symlink()]
    return max(files, key=lambda f: f.stat().st_size, default=None)


def measure_read(file: Path, limit: int = READ_BYTES) -> ReadSpeed:
    """Read up to `limit` bytes from the start of `file`, dropped from the page cache first (see the module
    docstring), and time it. OSError when the file cannot be read."""
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # no link out, no FIFO wait
    try:
        size = min(os.fstat(fd).st_size, limit)
        with contextlib.suppress(OSError):
            os.fdatasync(fd)  # dirty pages are not dropped
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        resident = resident_fraction(fd, size)
        buffer = memoryview(bytearray(min(CHUNK, max(size, 1))))
        got, start = 0, time.perf_counter()
        while got < size:
            n = os.preadv(fd, [buffer[: min(CHUNK, size - got)]], got)
            if n <= 0:
                break
            got += n
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return ReadSpeed(got, seconds, file.name, resident)


def measure_scratch_read(directory: Path, size: int = SCRATCH_BYTES) -> ReadSpeed:
    """Write a `size`-byte file of random bytes in `directory` (a new name, never an existing file), fsync it, then
    time its read as `measure_read` does; the file is removed whatever happens. OSError (no space, no permission)
    when it cannot be written."""
    path = directory / f"{SCRATCH_PREFIX}{os.getpid()}-{time.monotonic_ns()}.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            block, written = os.urandom(min(CHUNK, size)), 0
            while written < size:
                written += os.write(fd, block[: size - written])
            os.fsync(fd)
        finally:
            os.close(fd)
        read = measure_read(path, size)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    return ReadSpeed(read.bytes_read, read.seconds, "a temporary file", read.resident)


def resident_fraction(fd: int, size: int) -> float | None:
    """The fraction of the first `size` bytes of the open file `fd` in the page cache (`mincore`); None where that
    cannot be asked."""
    if size <= 0:
        return None
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vector) != 0:
                return None
            return sum(b & 1 for b in bytes(vector)) / pages
        finally:
            libc.munmap(address, size)
    except (OSError, AttributeError, ValueError):
        return None
