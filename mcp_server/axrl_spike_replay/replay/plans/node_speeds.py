"""This machine's read and compute speeds, for the estimated time of the plan's streamed row (`streamed_plan`):
measured once per node, bounded, and kept in a cache file so that later plans reuse them.

- Read: up to `READ_BYTES` (256 MiB) from the start of the largest data file of the snapshot's checkpoint (DCP
  `.distcp`, safetensors, a verl rank shard; where the policy's weights are, `hf_weights_dir`), in 8 MiB reads,
  timed. That region is first dropped from the page cache (its dirty pages written, then `posix_fadvise`
  DONTNEED, which any reader of a file may ask); what the kernel still holds of it just before the read
  (`mincore` on a map of the region: a tmpfs, say) is said: above half, the read was from the page cache, so the
  speed is memory's, not the disk's. Kept per host and file system (its device number), and measured again where
  a later snapshot's file offers a longer read than the one kept.
- Compute: a square matmul in the replay's compute dtype on the plan's device (CPU: on one intra-op thread, as
  every replay process computes), repeated until `COMPUTE_SECONDS` have passed after a warm-up, timed (CUDA:
  synchronized). A matmul's speed: the replay's layers (attention, routing, small experts) run slower than it.
  Kept per host, device (its name) and dtype.

Nothing here raises: a speed that cannot be measured (no checkpoint file, no GPU, a file that cannot be read) is
left to the row's assumed one, with the reason (`streamed_plan.Speeds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.replay.streamed.streamed_plan import Speeds

READ_BYTES = 256 << 20
CHUNK = 8 << 20
COMPUTE_SECONDS = 0.25
MATMUL_SIDE = {"cpu": 512, "cuda": 4096}
MAX_CACHE_BYTES = 1 << 20
_DATA_FILES = ("*.distcp", "*.safetensors", "model_world_size_*_rank_*.pt")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def measure_compute(device: str, dtype: torch.dtype, seconds: float = COMPUTE_SECONDS) -> tuple[float, str]:
    """(FLOP/s, what ran) of a square matmul on `device` in `dtype`, repeated for about `seconds` after a warm-up
    (CPU: one intra-op thread)."""
    side = MATMUL_SIDE.get(device, MATMUL_SIDE["cpu"])
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(side, side, generator=generator, device=device).to(dtype)
        b = torch.randn(side, side, generator=generator, device=device).to(dtype)
        out = a @ b  # the warm-up
        _sync(device, out)
        count, elapsed = 1, 0.0
        while True:
            start = time.perf_counter()
            for _ in range(count):
                out = a @ b
            _sync(device, out)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
            count *= 2
    finally:
        torch.set_num_threads(threads)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu, 1 thread"
    dtype_name = str(dtype).removeprefix("torch.")
    return 2.0 * side**3 * count / elapsed, f"{side}x{side} {dtype_name} matmul on {name}"


def _sync(device: str, tensor: torch.Tensor) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    else:
        float(tensor[0, 0])


def node_speeds(weights_dir: Path | None, device: str, dtype: str, cache: Path | None) -> Speeds:
    """This machine's speeds for a streamed replay on `device` in `dtype` reading the checkpoint in `weights_dir`:
    each from `cache` when it holds one for this host (and file system, device, dtype), else measured and added to
    it; the assumed one, with the reason, where it cannot be measured."""
    host = socket.gethostname()
    doc = _load(cache)
    speeds = Speeds.assumed(device)
    read = _read_entry(doc, host, weights_dir)
    if read is None:
        why = "assumed (no checkpoint data file in the snapshot to read)"
        speeds = dataclasses.replace(speeds, read_how=why)
    else:
        speeds = speeds.with_read(read["bytes_per_s"], read["how"], read.get("cached"))
    compute = _compute_entry(doc, host, device, _TORCH_DTYPES.get(dtype, torch.float32))
    if compute is None:
        why = "no GPU visible here to measure" if device == "cuda" else "the matmul did not run"
        speeds = dataclasses.replace(speeds, compute_how=f"assumed ({why})")
    else:
        speeds = speeds.with_compute(compute["flops_per_s"], compute["how"])
    if cache is not None and any(entry is not None and entry.get("new") for entry in (read, compute)):
        with contextlib.suppress(OSError):
            atomic_write_json(cache, doc)
    return speeds


def _load(cache: Path | None) -> dict[str, Any]:
    """The cache's entries ({"read": {key: entry}, "compute": {key: entry}}); empty when absent or unreadable."""
    doc: dict[str, Any] = {"read": {}, "compute": {}}
    if cache is None:
        return doc
    try:
        if cache.stat().st_size > MAX_CACHE_BYTES:
            return doc
        found = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return doc
    if isinstance(found, dict):
        for kind in doc:
            if isinstance(found.get(kind), dict):
                doc[kind] = found[kind]
    return doc


def _kept(entry: Any, speed: str) -> bool:
    """Whether a cache entry holds a usable `speed` (a positive number, and a byte count that is one)."""
    if not isinstance(entry, dict):
        return False
    value, count = entry.get(speed), entry.get("bytes", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(count, int):
        return False
    return value > 0 and count >= 0


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _read_entry(doc: dict[str, Any], host: str, weights_dir: Path | None) -> dict[str, Any] | None:
    """The read speed of `weights_dir`'s file system on this host: kept, or measured now (marked new)."""
    if weights_dir is None or not weights_dir.is_dir():
        return None
    key = f"{host} fs {weights_dir.stat().st_dev}"
    kept = doc["read"].get(key)
    file = checkpoint_data_file(weights_dir)
    offers = 0 if file is None else min(file.stat().st_size, READ_BYTES)
    if _kept(kept, "bytes_per_s") and (file is None or offers <= kept.get("bytes", 0)):  # else a longer read now
        return {**kept, "how": f"{kept.get('how', 'measured')}, kept from {kept.get('at', 'earlier')}"}
    if file is None:
        return None
    try:
        read = measure_read(file)
    except OSError:
        return None
    if read.bytes_read <= 0 or read.seconds <= 0:
        return None
    where = "page cache unknown" if read.cached is None else "from disk"
    where = "from the page cache: memory's speed, not the disk's" if read.cached else where
    entry = {
        "bytes_per_s": read.bytes_read / read.seconds,
        "how": f"measured, {read.bytes_read / (1 << 20):.3g} MiB of {read.file} {where}",
        "cached": read.cached,
        "bytes": read.bytes_read,
        "at": _stamp(),
    }
    doc["read"][key] = entry
    return {**entry, "new": True}


def _compute_entry(doc: dict[str, Any], host: str, device: str, dtype: torch.dtype) -> dict[str, Any] | None:
    """The matmul speed on `device` in `dtype` on this host: kept, or measured now (marked new); None: no such
    device here."""
    if device == "cuda" and not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    key = f"{host} {device} {name} {str(dtype).removeprefix('torch.')}"
    kept = doc["compute"].get(key)
    if _kept(kept, "flops_per_s"):
        return {**kept, "how": f"{kept.get('how', 'measured')}, kept from {kept.get('at', 'earlier')}"}
    try:
        flops, what = measure_compute(device, dtype)
    except (RuntimeError, ValueError):
        return None
    entry = {"flops_per_s": flops, "how": f"measured, {what}", "at": _stamp()}
    doc["compute"][key] = entry
    return {**entry, "new": True}
