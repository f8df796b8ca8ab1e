"""Host memory a replay process gives back when it frees a tensor.

glibc's malloc serves a block under its mmap threshold from its heap, and keeps freed heap blocks for reuse; the
threshold also rises with each larger block freed (up to 32 MiB). A replay frees and reallocates layer-sized
tensors all step long (FSDP2's gathered units, the gradients it reduce-scatters), so freed blocks stay in the
process's resident memory: 171 MiB still held after the backward of a 338 M-parameter model sharded over 4
processes (`benchmarks/bench_sharded_replay.py`). A fixed threshold (glibc's initial 128 KiB) maps every larger
block on its own and unmaps it when freed.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
FIXED_MMAP_THRESHOLD = 128 << 10


def return_freed_host_memory() -> bool:
    """Fix glibc's mmap threshold in this process, so freed tensors leave its resident memory; False where the C
    library is not glibc (nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, FIXED_MMAP_THRESHOLD))
