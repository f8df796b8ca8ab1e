"""Awaiting remote work that a cancelled call (an MCP cancel, set from another thread) must stop on every node."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def cancellable(work: Awaitable[T], cancel: threading.Event | None, stopped: Exception) -> T:
    """Await `work`; when `cancel` gets set, cancel it (its own clean-up runs, as on Ctrl-C) and raise `stopped`."""
    task = asyncio.ensure_future(work)
    while cancel is not None and not task.done():
        await asyncio.wait({task}, timeout=0.2)
        if cancel.is_set() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise stopped
    return await task
