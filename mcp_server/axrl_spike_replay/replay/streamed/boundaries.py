"""Where a streamed replay keeps the step's layer boundaries: host memory up to a budget, a spill dir beyond it.

A boundary is what one micro-batch carries between two decoder layers (its hidden states, and what the loss needs
of a layer: router logits or losses, the routes it took), or the gradient flowing back through them. Each is put
under a key and read back by it. Boundaries are kept on the host whatever device computes them (a GPU holds one
layer's work only) and handed back on that device. While the tensors held in memory stay under `budget_bytes` they
stay there; past it, a boundary is written to the spill dir (`torch.save` into a temporary name, renamed once
complete) and read back weights-only. A spill dir that fills up stops the replay with an error naming the dir and
the bytes it holds, the partial file removed. The spill dir is the store's own: made on first spill and removed
with everything in it on `close` (also when the process is killed: `temp_janitor`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from axrl_spike_replay.errors import AxrlError

Boundary = tuple[torch.Tensor | None, ...]


class SpillDirFull(AxrlError):
    """The spill dir has no room for another boundary."""


@dataclass
class StoreFigures:
    """What a store held at most: bytes in memory, bytes on disk, and how many boundaries were spilled."""

    peak_memory: int = 0
    peak_disk: int = 0
    spilled: int = 0


def boundary_bytes(value: Sequence[torch.Tensor | None]) -> int:
    """Bytes of a boundary's tensors."""
    return sum(t.numel() * t.element_size() for t in value if t is not None)


class BoundaryStore:
    """Boundaries by key: in memory up to `budget_bytes`, spilled under `spill_root` (default: the temp dir)."""

    def __init__(self, budget_bytes: int, spill_root: str | Path | None = None, device: str = "cpu") -> None:
        self.device = torch.device(device)  # where `get` hands boundaries back; they are kept on the host
        self.budget = max(int(budget_bytes), 0)
        self.spill_root = Path(spill_root) if spill_root is not None else None
        self.memory: dict[Hashable, Boundary] = {}
        self.disk: dict[Hashable, tuple[Path, int]] = {}
        self.memory_bytes = 0
        self.disk_bytes = 0
        self.figures = StoreFigures()
        self.spill_dir: Path | None = None
        self._janitor: contextlib.ExitStack | None = None
        self._count = 0

    def put(self, key: Hashable, value: Sequence[torch.Tensor | None]) -> None:
        """Keep `value` (detached, contiguous) under `key`, replacing what was there."""
        self.drop(key)
        kept: Boundary = tuple(None if t is None else t.detach().to("cpu") for t in value)
        size = boundary_bytes(kept)
        if self.memory_bytes + size <= self.budget:
            self.memory[key] = kept
            self.memory_bytes += size
            self.figures.peak_memory = max(self.figures.peak_memory, self.memory_bytes)
            return
        path = self._write(kept, size)
        self.disk[key] = (path, size)
        self.disk_bytes += size
        self.figures.spilled += 1
        self.figures.peak_disk = max(self.figures.peak_disk, self.disk_bytes)

    def get(self, key: Hashable) -> Boundary:
        """The boundary under `key` (KeyError when none)."""
        if key in self.memory:
            held = self.memory[key]
        else:
            path, _ = self.disk[key]
            held = tuple(torch.load(path, weights_only=True))
        if self.device.type == "cpu":
            return held
        return tuple(None if t is None else t.to(self.device) for t in held)

    def drop(self, key: Hashable) -> None:
        """Forget `key` (nothing when absent)."""
        value = self.memory.pop(key, None)
        if value is not None:
            self.memory_bytes -= boundary_bytes(value)
        spilled = self.disk.pop(key, None)
        if spilled is not None:
            spilled[0].unlink(missing_ok=True)
            self.disk_bytes -= spilled[1]

    def nbytes(self, key: Hashable) -> int:
        """Bytes of the boundary under `key` (0 when none), read from neither memory nor disk."""
        if key in self.memory:
            return boundary_bytes(self.memory[key])
        return self.disk[key][1] if key in self.disk else 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.memory or key in self.disk

    def _dir(self) -> Path:
        if self.spill_dir is None:
            from axrl_spike_replay.files.temp_janitor import removed_if_killed

            root = self.spill_root or Path(tempfile.gettempdir())
            root.mkdir(parents=True, exist_ok=True)
            self.spill_dir = Path(tempfile.mkdtemp(prefix="axrl-boundaries-", dir=root))
            self._janitor = contextlib.ExitStack()
            self._janitor.enter_context(removed_if_killed(str(self.spill_dir)))
        return self.spill_dir

    def _write(self, value: Boundary, size: int) -> Path:
        directory = self._dir()
        self._count += 1
        path = directory / f"b{self._count}.pt"
        partial = directory / f".b{self._count}.pt.partial"
        try:
            torch.save(list(value), partial)
            os.replace(partial, path)
        except (OSError, RuntimeError) as exc:
            partial.unlink(missing_ok=True)
            what = "is full" if _full(exc, directory, size) else "could not be written"
            raise SpillDirFull(
                f"the boundary spill dir {directory} {what} ({type(exc).__name__}: {exc}) after "
                f"{self.disk_bytes:,} bytes spilled; a boundary of {size:,} bytes did not fit: free space there, "
                "give a larger host memory budget, or another spill dir"
            ) from exc
        return path

    def close(self) -> None:
        """Forget every boundary and remove the spill dir with everything in it."""
        self.memory.clear()
        self.disk.clear()
        self.memory_bytes = self.disk_bytes = 0
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)
            self.spill_dir = None
        if self._janitor is not None:
            self._janitor.close()
            self._janitor = None


def _full(exc: BaseException, directory: Path, size: int) -> bool:
    """Whether a failed write ran out of room: ENOSPC / EDQUOT, or less free space left there than the boundary
    (torch's archive writer reports a failed write without the errno)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(directory).free < size + (1 << 16)
    except OSError:
        return False


@contextlib.contextmanager
def boundary_store(
    budget_bytes: int, spill_root: str | Path | None = None, device: str = "cpu"
) -> Iterator[BoundaryStore]:
    """A store closed (spill dir removed) however the block ends."""
    store = BoundaryStore(budget_bytes, spill_root, device)
    try:
        yield store
    finally:
        store.close()
