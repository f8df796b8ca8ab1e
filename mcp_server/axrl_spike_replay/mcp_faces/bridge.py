"""Run a library call from an MCP tool: in a worker thread, with progress, cancellation and clean errors.

Synchronous library functions: a tool awaits `call_library(ctx, work)`, where `work(progress, cancel)` calls
one library function in a worker thread. `progress(done, total, message)` becomes `notifications/progress`
for callers that asked for it; `cancel` (a `threading.Event`) is set when the caller cancels the request,
and the cancellation completes only once `work` has returned, so work that watches `cancel` has stopped.
Asynchronous library functions (SSH sessions): `call_async_library(ctx, work)` awaits them in the event
loop, where a cancelled request cancels them and their sessions kill what they started.
Expected failures (`AxrlError`, OS errors) become tool errors whose text is the library's message;
anything else is a crash: its traceback goes to the server's log (stderr) and the tool error names
its type with a bounded message, so the caller always learns what went wrong.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pydantic_core
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent
from pydantic import BaseModel, TypeAdapter

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError

T = TypeVar("T")
log = logging.getLogger("axrl_spike_replay.mcp")
CRASH_MESSAGE_LIMIT = 300

# How long a cancelled call waits for the library to stop its work before giving up on it.
CANCEL_GRACE_S = 60.0


class Progress:
    """Thread-safe progress reporter handed to library code; always increasing, as MCP requires.

    Made in the event loop; callable from any thread, not only the worker thread the call runs in (a sweep's
    pools report from threads of their own)."""

    def __init__(self, ctx: Context | None) -> None:
        self._ctx = ctx
        self._last = 0.0
        self._lock = threading.Lock()
        self._token = anyio.lowlevel.current_token() if ctx is not None else None
        self._cancelled = anyio.get_cancelled_exc_class() if ctx is not None else RuntimeError

    def __call__(self, done: float | None = None, total: float | None = None, message: str | None = None) -> None:
        """Report `done` of `total` (or one more step when `done` is None) with an optional message."""
        with self._lock:
            value = max(float(done) if done is not None else self._last + 1.0, self._last + 1e-9)
            self._last = value
        if self._ctx is None:
            return
        # RuntimeError / cancelled: the request is gone; the work keeps its own pace.
        with contextlib.suppress(RuntimeError, self._cancelled):
            anyio.from_thread.run(self._ctx.report_progress, value, total, message, token=self._token)

    def message(self, text: str) -> None:
        """One more step, described by `text`."""
        self(None, None, text)


def tool_error(exc: BaseException) -> ToolError:
    """A tool error carrying the library's own message (what was wrong, what to do)."""
    if isinstance(exc, OSError) and not isinstance(exc, AxrlError):
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        return ToolError(f"{where}{exc.strerror or exc}")
    return ToolError(str(exc))


def crash_error(exc: BaseException, tool: str | None = None) -> ToolError:
    """A tool error for an unexpected exception: its type and a bounded message; the traceback is logged."""
    log.error("tool %s raised an unexpected exception", tool or "call", exc_info=exc)
    message = shown(str(exc), CRASH_MESSAGE_LIMIT, quote=False) or "(no message)"
    prefix = f"Error executing tool {tool}: " if tool else ""  # the SDK adds it to errors raised inside a tool
    return ToolError(
        f"{prefix}unexpected {type(exc).__name__}: {message} (an internal error; the traceback is in the server's log)"
    )


def failure_error(exc: Exception) -> ToolError:
    """The tool error for a failure of library code: its own message when expected, else a crash report."""
    if isinstance(exc, ToolError):
        return exc
    if isinstance(exc, (AxrlError, OSError)):
        return tool_error(exc)
    return crash_error(exc)


async def call_library(ctx: Context | None, work: Callable[[Progress, threading.Event], T]) -> T:
    """Run `work(progress, cancel)` in a worker thread; cancellation sets `cancel` and waits for it to stop."""
    progress = Progress(ctx)
    cancel = threading.Event()
    finished = threading.Event()

    def run() -> T:
        try:
            return work(progress, cancel)
        finally:
            finished.set()

    try:
        return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        cancel.set()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(finished.wait, CANCEL_GRACE_S)
        raise
    except Exception as exc:
        raise failure_error(exc) from exc


async def call_async_library(ctx: Context | None, work: Callable[[Callable[[str], None]], Awaitable[T]]) -> T:
    """Await `work(report)` in the server's event loop (asyncio: SSH sessions, remote process groups).

    `report(message)` may be called from synchronous library code; each call becomes one progress
    notification. Cancelling the request cancels `work`, whose sessions then kill what they started.
    """
    send, receive = anyio.create_memory_object_stream[tuple[float, str]](max_buffer_size=math.inf)
    counter = itertools.count(1)

    def report(message: str) -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            send.send_nowait((float(next(counter)), message))

    async def pump() -> None:
        async with receive:
            async for value, message in receive:
                if ctx is not None:
                    with contextlib.suppress(Exception):  # a gone client must not fail the work
                        await ctx.report_progress(value, None, message)

    failure: Exception | None = None
    done: list[T] = []  # the work's result, once it returned (raised only after the task group closed)
    async with anyio.create_task_group() as group:
        group.start_soon(pump)
        try:
            done.append(await work(report))
        except Exception as exc:
            failure = exc
        finally:
            send.close()
    if failure is not None:
        raise failure_error(failure) from failure
    return done[0]


def png_content(png: bytes) -> ImageContent:
    """An MCP image block for PNG bytes."""
    return ImageContent(type="image", data=base64.b64encode(png).decode("ascii"), mime_type="image/png")


def structured(model: type[Any], value: Any, images: Sequence[bytes] = ()) -> CallToolResult:
    """A tool result with `value` as structured content (validated as `model`), its JSON as text, and images."""
    adapter: TypeAdapter[Any] = TypeAdapter(model)
    validated = adapter.validate_python(value, from_attributes=True)
    doc = (
        validated.model_dump(mode="json")
        if isinstance(validated, BaseModel)
        else adapter.dump_python(validated, mode="json")
    )
    content: list[Any] = [
        TextContent(type="text", text=pydantic_core.to_json(doc, indent=1, inf_nan_mode="null").decode())
    ]
    content += [png_content(png) for png in images]
    return CallToolResult(content=content, structured_content=doc)


def resolve_in(workspace: Path, path: str) -> Path:
    """`path` as given when absolute, else relative to the server's workspace."""
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else workspace / candidate
