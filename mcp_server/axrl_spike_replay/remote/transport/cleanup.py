"""Clean-up that survives cancellation: killing a remote process group must finish even while the caller is
being cancelled, including anyio's level cancellation (an MCP call's cancel scope cancels every await)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def run_to_completion(work: Awaitable[T]) -> T:
    """Await `work` to its end even if this task is cancelled meanwhile; then re-raise that cancellation.

    `work` must bound its own duration (timeouts), since cancelling the caller no longer stops it.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True  # keep waiting: each await may be cancelled again (level cancellation)
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved, so an error in the clean-up is not logged as never retrieved
        raise asyncio.CancelledError
    return task.result()
