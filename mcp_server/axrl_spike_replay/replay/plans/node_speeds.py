"""A node's read and compute speeds, for the estimated time of the plan's streamed row (`streamed_plan`): measured
once per node, bounded, and kept in a cache so that later plans reuse them. This machine's are kept in a cache file
(`node_speeds`); an SSH node runs `speeds_from` itself (`node_speeds_main`), with the entries its planner kept for it.

- Read (`read_speed`): up to 256 MiB from the start of the largest data file of the snapshot's checkpoint (DCP
  `.distcp`, safetensors, a verl rank shard; where the policy's weights are, `hf_weights_dir`), dropped from the page
  cache first, timed, and whether it came from disk or the page cache said. Where the node holds no copy of the
  snapshot's weights and a directory on its replay disk is given, a temporary file written there instead. Kept per
  host and file system (its device number), and measured again where a later snapshot's file offers a longer read
  than the one kept.
- Compute: a square matmul in the replay's compute dtype on the plan's device (CPU: on one intra-op thread, as
  every replay process computes), repeated until `COMPUTE_SECONDS` have passed after a warm-up, timed (CUDA:
  synchronized). A matmul's speed: the replay's layers (attention, routing, small experts) run slower than it.
  Kept per host, device (its name) and dtype.

A kept entry that is not a positive speed, or older than `MAX_AGE_S`, is measured again. Nothing here raises: a speed
that cannot be measured (no checkpoint file, no GPU, a file that cannot be read or written) is left to the row's
assumed one, with the reason (`streamed_plan.Speeds`). torch is imported only to measure or name a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.replay.plans.read_speed import (
    ReadSpeed,
    checkpoint_data_file,
    measure_read,
    measure_scratch_read,
)
from axrl_spike_replay.replay.streamed.speeds import Speeds
from axrl_spike_replay.untrusted.untrusted_bytes import read_bounded
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json

if TYPE_CHECKING:
    import torch

READ_BYTES = 256 << 20
COMPUTE_SECONDS = 0.25
MATMUL_SIDE = {"cpu": 512, "cuda": 4096}
MAX_CACHE_BYTES = 1 << 20
MAX_CACHE_DEPTH = 8  # {hosts: {identity: {read: {key: entry}}}}: 5 levels at most
MAX_AGE_S = 7 * 24 * 3600.0  # a kept speed older than a week is measured again (a node's disks and load change)
DTYPES = ("float32", "bfloat16", "float16")


def measure_compute(device: str, dtype: torch.dtype, seconds: float = COMPUTE_SECONDS) -> tuple[float, str]:
    """(FLOP/s, what ran) of a square matmul on `device` in `dtype`, repeated for about `seconds` after a warm-up
    (CPU: one intra-op thread)."""
    import torch

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
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    else:
        float(tensor[0, 0])


def node_speeds(weights_dir: Path | None, device: str, dtype: str, cache: Path | None) -> Speeds:
    """This machine's speeds for a streamed replay on `device` in `dtype` reading the checkpoint in `weights_dir`:
    each from `cache` when it holds one for this host (and file system, device, dtype), else measured and added to
    it; the assumed one, with the reason, where it cannot be measured."""
    doc = load_speeds_cache(cache)
    speeds, new = speeds_from(doc, socket.gethostname(), weights_dir, device, dtype)
    if cache is not None and new:
        with contextlib.suppress(OSError):
            atomic_write_json(cache, doc)
    return speeds


def speeds_from(
    doc: dict[str, Any],
    host: str,
    weights_dir: Path | None,
    device: str,
    dtype: str,
    scratch: Path | str | None = None,
) -> tuple[Speeds, bool]:
    """(speeds, whether any was measured now) on this machine, known as `host` in `doc` (a cache document, see
    `speeds_document`; what is measured is added to it). Where `weights_dir` holds no checkpoint data file, the read
    is measured on a temporary file in `scratch` when given (a str: why there is no such directory)."""
    speeds = Speeds.assumed(device)
    read = _read_entry(doc, host, weights_dir)
    if read is None and scratch is not None:
        read = _scratch_entry(doc, host, scratch)
    if read is None:
        speeds = dataclasses.replace(speeds, read_how="assumed (no checkpoint data file in the snapshot to read)")
    elif isinstance(read, str):
        speeds = dataclasses.replace(speeds, read_how=f"assumed ({read})")
    else:
        speeds = speeds.with_read(read["bytes_per_s"], read["how"], read.get("cached"))
    compute = _compute_entry(doc, host, device, dtype)
    if compute is None:
        why = "no GPU visible here to measure" if device == "cuda" else "the matmul did not run"
        speeds = dataclasses.replace(speeds, compute_how=f"assumed ({why})")
    else:
        speeds = speeds.with_compute(compute["flops_per_s"], compute["how"])
    return speeds, any(isinstance(e, dict) and bool(e.get("new")) for e in (read, compute))


def read_kept(cache: Path | None) -> Any:
    """What a speeds cache file holds (JSON), None when absent, too large, not a regular file (a symlink, a FIFO),
    too deep or unreadable: a kept speed is measured again rather than trusted."""
    if cache is None:
        return None
    try:
        return parse_untrusted_json(read_bounded(cache, MAX_CACHE_BYTES, follow_symlinks=False), MAX_CACHE_DEPTH)
    except (OSError, ValueError):  # UntrustedInputError is a ValueError
        return None


def load_speeds_cache(cache: Path | None) -> dict[str, Any]:
    """The cache file's entries (`speeds_document`); empty when absent, too large or unreadable (`read_kept`)."""
    return speeds_document(read_kept(cache))


def speeds_document(found: Any) -> dict[str, Any]:
    """A cache document ({"read": {key: entry}, "compute": {key: entry}}) from what a file or a request held: its
    two mappings where they are ones, else empty (each entry is checked when used, `_kept`)."""
    doc: dict[str, Any] = {"read": {}, "compute": {}}
    if isinstance(found, dict):
        for kind in doc:
            if isinstance(found.get(kind), dict):
                doc[kind] = found[kind]
    return doc


def _kept(entry: Any, speed: str) -> bool:
    """Whether a cache entry holds a usable `speed` (a positive number, and a byte count that is one), measured less
    than `MAX_AGE_S` ago."""
    if not isinstance(entry, dict):
        return False
    value, count, when = entry.get(speed), entry.get("bytes", 0), entry.get("epoch")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(count, int):
        return False
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= time.time() - when <= MAX_AGE_S:
        return False  # stale, from the future, or without a date
    return value > 0 and count >= 0


def _kept_entry(kept: dict[str, Any]) -> dict[str, Any]:
    return {**kept, "how": f"{kept.get('how', 'measured')}, kept from {kept.get('at', 'earlier')}"}


def _stamped(entry: dict[str, Any]) -> dict[str, Any]:
    now = time.time()
    return {**entry, "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(now)), "epoch": now}


def _read_entry(doc: dict[str, Any], host: str, weights_dir: Path | None) -> dict[str, Any] | None:
    """The read speed of `weights_dir`'s file system on this host: kept, or measured now (marked new)."""
    if weights_dir is None or not weights_dir.is_dir():
        return None
    key = f"{host} fs {weights_dir.stat().st_dev}"
    kept = doc["read"].get(key)
    file = checkpoint_data_file(weights_dir)
    offers = 0 if file is None else min(file.stat().st_size, READ_BYTES)
    if _kept(kept, "bytes_per_s") and (file is None or offers <= kept.get("bytes", 0)):  # else a longer read now
        return _kept_entry(kept)
    if file is None:
        return None
    try:
        read = measure_read(file, READ_BYTES)
    except OSError:
        return None
    return _measured(doc, key, read, "")


def _scratch_entry(doc: dict[str, Any], host: str, scratch: Path | str) -> dict[str, Any] | str | None:
    """The read speed of a temporary file in `scratch` (the replay disk of a node without the snapshot's weights):
    kept for its file system, or measured now (marked new); why not, in words, where it cannot be."""
    if isinstance(scratch, str):
        return f"no copy of the snapshot's weights here, and {scratch}"
    try:
        key = f"{host} scratch fs {scratch.stat().st_dev}"
        kept = doc["read"].get(key)
        if _kept(kept, "bytes_per_s"):
            return _kept_entry(kept)
        read = measure_scratch_read(scratch)
    except OSError as exc:
        return f"no copy of the snapshot's weights here, and a temporary file in {scratch} could not be read: {exc}"
    return _measured(doc, key, read, f" written in {scratch.parent} (no copy of the snapshot's weights there)")


def _measured(doc: dict[str, Any], key: str, read: ReadSpeed, note: str) -> dict[str, Any] | None:
    """A new read entry, added to `doc` under `key`; None for an empty read."""
    if read.bytes_read <= 0 or read.seconds <= 0:
        return None
    entry = _stamped(
        {
            "bytes_per_s": read.bytes_read / read.seconds,
            "how": f"measured, {read.bytes_read / (1 << 20):.3g} MiB of {read.file}{note} {read.where}",
            "cached": read.cached,
            "bytes": read.bytes_read,
        }
    )
    doc["read"][key] = entry
    return {**entry, "new": True}


def _compute_entry(doc: dict[str, Any], host: str, device: str, dtype: str) -> dict[str, Any] | None:
    """The matmul speed on `device` in `dtype` on this host: kept, or measured now (marked new); None: no such
    device here."""
    dtype = dtype if dtype in DTYPES else "float32"
    name = "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    key = f"{host} {device} {name} {dtype}"
    kept = doc["compute"].get(key)
    if _kept(kept, "flops_per_s"):
        return _kept_entry(kept)
    try:
        import torch

        flops, what = measure_compute(device, getattr(torch, dtype))
    except (RuntimeError, ValueError):
        return None
    entry = _stamped({"flops_per_s": flops, "how": f"measured, {what}"})
    doc["compute"][key] = entry
    return {**entry, "new": True}
