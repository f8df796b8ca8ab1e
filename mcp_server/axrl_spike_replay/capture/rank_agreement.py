"""All ranks agree on how a step they each did went, so they go on or stop together and none waits for a peer.

A collective write (a snapshot) has parts each rank does alone: rank 0 makes the directory, every rank writes
its files. A rank that raised out of such a part and left while its peers went on to the next barrier would
leave them waiting for it for good (NCCL's watchdog, if anything, ends the job). Instead every rank catches its
own failure and passes it to `agree`, an all-gather of each rank's outcome (None, or the error's text): every
rank then holds every rank's outcome and takes the same branch. `all_gather_object` picks the group's device
itself, so it serves gloo and NCCL groups alike.
"""

from __future__ import annotations

import re
from typing import Any


def describe(exc: BaseException) -> str:
    """An exception as one line: its type and message (an OSError's errno text and file name included); for
    torch.distributed.checkpoint's CheckpointException, each failing rank's own exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = [(rank, f[0] if isinstance(f, tuple) and f else f) for rank, f in sorted(failures.items())]
        parts = [f"rank {rank}: {describe(e) if isinstance(e, BaseException) else e}" for rank, e in inner]
        return f"{type(exc).__name__} ({'; '.join(parts)})"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree(outcome: Any) -> list[Any]:
    """Every rank's `outcome`, in rank order, on every rank (collective under torch.distributed; else `[outcome]`).

    Outcomes are small picklable values: None for success, an error's text, a name rank 0 chose."""
    import torch.distributed as dist

    world = _world_size()
    if world == 1:
        return [outcome]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, outcome)
    return gathered


def failures(errors: list[str | None]) -> str | None:
    """The ranks' errors as one line (`rank 1: OSError: ...; rank 3: ...`), None when every rank succeeded."""
    found = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if not found:
        return None
    if len(errors) == 1:
        return found[0][1]
    return "; ".join(f"rank {rank}: {error}" for rank, error in found)


def error_kind(text: str) -> str:
    """The kind of a described error (`describe`), for logging each kind once: its type, and an OSError's errno
    (`OSError [Errno 28]`), without the file name."""
    kind = text.split(":", 1)[0].strip()
    errno = re.search(r"\[Errno \d+\]", text)
    return f"{kind} {errno.group(0)}" if errno else kind
