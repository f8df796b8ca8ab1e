"""Every request line over stdio gets a reply, as JSON-RPC 2.0 says, even one the SDK's transport cannot take.

The SDK's stdio transport (`mcp.server.stdio`) parses each line with pydantic and hands what it refuses to the
server, which logs and drops it: the client waits for its reply forever. It also takes a request whose id is not a
string or an integer (an object, null, 1.5) for a notification, which is never answered. Some lines it refuses:

- a lone UTF-16 surrogate (`"\\ud800"`: valid JSON syntax, not valid Unicode; a JavaScript client sends it for a
  string cut in the middle of an emoji, a Python one for an undecodable file name);
- arrays and objects nested deeper than its parser's limit (3,000 brackets once ended the server: Python's own
  parser, which read the line back, raised RecursionError);
- a message without `method`, a batch (an array: MCP has no batches since 2025-06-18), a wrong `jsonrpc`.

`AnsweringReadStream` sits between the transport and the server. It sees each line the transport read
(`RecordingLines`: the transport turns each line into exactly one message or error, in order) and answers:

- a line that is no JSON: Parse error (-32700), id null;
- a request the transport refused: Invalid Request (-32600) or Invalid params (-32602) to its id, saying what is
  wrong (where the lone surrogate is, how deep it nests, which member is missing); id null where the id cannot be
  read (absent with a `method` that is not a string, an object, null, a number with a fraction, a lone surrogate);
- a batch: Invalid Request to each request's id in it (one line each: the transport writes one message per line),
  or one with id null when none has an id;
- a notification or a response it refused, a blank line: nothing (nothing waits on an answer to them).

Nesting is measured before any parse and cut at `MAX_DEPTH` (`untrusted_json`'s linear scan), so reading a line
back costs time linear in its length and a bounded stack.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import io
import json
import os
import sys
from collections.abc import Iterator
from types import TracebackType
from typing import IO, Any

import anyio
from mcp.shared.message import SessionMessage
from mcp.types import INVALID_PARAMS, INVALID_REQUEST, PARSE_ERROR, ErrorData, JSONRPCError, JSONRPCNotification
from pydantic import ValidationError

from axrl_spike_replay.display import shown
from axrl_spike_replay.untrusted.untrusted_json import json_within

MAX_DEPTH = 64  # read back this deep; deeper parts of a refused line are cut (the SDK refuses about 200 levels)
MAX_BATCH_REPLIES = 1024  # requests of one batch answered by id; the rest are said in one reply with id null
_BATCH = "JSON-RPC batches are not served (MCP has none since protocol 2025-06-18): send each message on its own line"


class RecordingLines(anyio.AsyncFile[str]):
    """The transport's stdin: each line it reads is also kept, in order, for `AnsweringReadStream`."""

    def __init__(self, fp: IO[str]) -> None:
        super().__init__(fp)
        self.lines: collections.deque[str] = collections.deque()

    async def readline(self) -> str:
        line = await super().readline()
        if line:
            self.lines.append(line)
        return line


class _UnownedText(io.TextIOWrapper):
    """A text layer whose close leaves the buffer under it open (it is not ours: sys.stdin's, or the wire's)."""

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.detach()


@contextlib.contextmanager
def claimed_stdin() -> Iterator[IO[str]]:
    """The client's stdin (the MCP wire) as UTF-8 text on a private descriptor; fd 0 reads /dev/null while the block
    runs, so the tools' child processes never read the wire (as the SDK's own stdio transport does), and is
    restored after."""
    try:
        wire = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    except OSError:
        yield _UnownedText(sys.stdin.buffer, encoding="utf-8", errors="replace")
        return
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
    finally:
        os.close(null)
    try:
        # never closed while serving: a worker thread may still block reading it (the SDK's reasoning too)
        yield _UnownedText(os.fdopen(wire, "rb", closefd=False), encoding="utf-8", errors="replace")
    finally:
        os.dup2(wire, 0)


class AnsweringReadStream:
    """The transport's read stream, less the lines it could not take: those are answered on `write_stream`. `lines`:
    the lines the transport read (`RecordingLines.lines`); without them only what the error itself holds is read."""

    def __init__(self, inner: Any, write_stream: Any, lines: collections.deque[str] | None = None) -> None:
        self._inner = inner
        self._write = write_stream
        self._lines = lines

    @property
    def last_context(self) -> Any:
        """The sender's context of the last item (the SDK's dispatcher reads it when there is one)."""
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        """The next message, or an exception the transport raised that has no request to answer."""
        while True:
            item = await self._inner.receive()
            line = self._lines.popleft() if self._lines else None
            if isinstance(item, Exception):
                replies = replies_to(line, item) if line is not None else _replies_from_error(item)
            elif line is not None and isinstance(item.message, JSONRPCNotification):
                replies = _bad_id_replies(line)  # a request whose id the transport dropped
            else:
                return item
            if not replies:
                return item  # nothing to answer: the server logs an error, and handles a message
            for reply in replies:
                await self._write.send(reply)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> AnsweringReadStream:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:  # the client closed stdin
            raise StopAsyncIteration from None

    async def __aenter__(self) -> AnsweringReadStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        return None


def replies_to(line: str | bytes, exc: Exception | None = None) -> list[SessionMessage] | None:
    """The JSON-RPC errors answering `line`, which the transport refused with `exc`: empty when nothing is to be
    answered (a notification, a response); None when `exc` is not about the line's content (passed on as it is)."""
    if exc is not None and not isinstance(exc, ValidationError):
        return None
    try:
        return _replies(line if isinstance(line, str) else line.decode("utf-8", "replace"), exc)
    except Exception:  # a reply that cannot be worked out must still not end the server
        return [_reply(None, INVALID_REQUEST, "the message could not be read")]


def _replies_from_error(exc: Exception) -> list[SessionMessage] | None:
    """Without the line: what the transport's error itself holds (the line, when it was no JSON to pydantic)."""
    if not isinstance(exc, ValidationError):
        return None
    errors = exc.errors(include_url=False)
    line = errors[0].get("input") if errors else None
    return replies_to(line, exc) if isinstance(line, (str, bytes)) else None


def _replies(line: str, exc: ValidationError | None) -> list[SessionMessage]:
    if not line.strip():
        return []  # a blank line carries no message
    read = _read_back(line, exc)
    if read is None:
        return [_reply(None, PARSE_ERROR, "the line is not JSON")]
    doc, deep = read
    if isinstance(doc, list):
        return _batch_replies(doc)
    if not isinstance(doc, dict):
        return [_reply(None, INVALID_REQUEST, f"a JSON-RPC message is an object, not {_kind(doc)}")]
    request_id = doc.get("id")
    readable = _readable_id(request_id)
    if "method" not in doc:
        if "result" in doc or "error" in doc:
            return []  # a response: no one waits on an answer to it
        return [_reply(request_id if readable else None, INVALID_REQUEST, "the request has no `method`")]
    if "id" not in doc and isinstance(doc["method"], str):
        return []  # a notification: never answered
    code, message = _what_is_wrong(doc, deep, exc)
    return [_reply(request_id if readable else None, code, message)]


def _what_is_wrong(doc: dict[str, Any], deep: bool, exc: ValidationError | None) -> tuple[int, str]:
    where = _surrogate_at(doc)
    if where is not None:
        code = INVALID_PARAMS if where.startswith("params") else INVALID_REQUEST
        return code, f"{where} holds a lone UTF-16 surrogate: not valid Unicode text; send text as valid UTF-8"
    if deep:
        return INVALID_REQUEST, f"the message nests arrays and objects deeper than {MAX_DEPTH} levels"
    if "id" in doc and not _readable_id(doc["id"]):
        return INVALID_REQUEST, f"`id` must be a string or an integer, not {_kind(doc['id'])}"
    if doc.get("jsonrpc") != "2.0":
        return INVALID_REQUEST, f'`jsonrpc` must be "2.0", got {shown(doc.get("jsonrpc"), 40)}'
    if not isinstance(doc["method"], str):
        return INVALID_REQUEST, f"`method` must be a string, not {_kind(doc['method'])}"
    if "params" in doc and not isinstance(doc["params"], dict):
        return INVALID_PARAMS, f"`params` must be an object, not {_kind(doc['params'])}"
    said = ""
    if exc is not None and (errors := exc.errors(include_url=False)):
        loc = ".".join(str(part) for part in errors[0].get("loc", ())[1:])
        said = f" ({shown(loc, 80, quote=False)}: {shown(errors[0].get('msg', ''), 120, quote=False)})"
    return INVALID_REQUEST, f"the request is not a valid JSON-RPC message{said}"


def _read_back(line: str, exc: ValidationError | None) -> tuple[Any, bool] | None:
    """The line's document, and whether arrays and objects nested deeper than MAX_DEPTH were cut from it (then
    read back from `json_within`); None for a line that is no JSON. Python's parser goes first: it stops at the
    first byte that is no JSON, and raises RecursionError (caught) where a line nests deeper than it recurses; a
    line the transport found too deep is cut whatever its depth here, so no walk below recurses far."""
    try:
        doc = json.loads(line)
    except RecursionError:
        doc = None
    except ValueError:
        return None
    if doc is not None and not _too_deep_for_the_transport(exc):
        return doc, False
    try:
        return json.loads(json_within(line, MAX_DEPTH)[0]), True
    except (ValueError, RecursionError):
        return None


def _too_deep_for_the_transport(exc: ValidationError | None) -> bool:
    """Whether the transport refused the line for nesting past its parser's recursion limit."""
    errors = exc.errors(include_url=False) if exc is not None else []
    return bool(errors) and errors[0].get("type") == "json_invalid" and "recursion" in str(errors[0].get("msg"))


def _bad_id_replies(line: str) -> list[SessionMessage] | None:
    """A notification to the transport whose line has an `id` it could not take: an Invalid Request, id null.
    (The transport parsed the line: it nests no deeper than its parser recurses, well within Python's.)"""
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or "id" not in doc or _readable_id(doc["id"]):
        return None
    return [_reply(None, INVALID_REQUEST, f"`id` must be a string or an integer, not {_kind(doc['id'])}")]


def _batch_replies(batch: list[Any]) -> list[SessionMessage]:
    ids = [
        m["id"] for m in batch if isinstance(m, dict) and isinstance(m.get("method"), str) and _readable_id(m.get("id"))
    ]
    replies = [_reply(i, INVALID_REQUEST, _BATCH) for i in ids[:MAX_BATCH_REPLIES]]
    if len(ids) > MAX_BATCH_REPLIES:
        replies.append(_reply(None, INVALID_REQUEST, f"{_BATCH} ({len(ids) - MAX_BATCH_REPLIES} more requests)"))
    return replies or [_reply(None, INVALID_REQUEST, "an empty batch" if not batch else _BATCH)]


def _readable_id(value: object) -> bool:
    """Whether an id can be sent back as it came: an integer (not a bool) or a string of valid Unicode."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, str) and not _lone_surrogate(value))


def _kind(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", float: "a number with a fraction"}
    return "null" if value is None else names.get(type(value), "a number")


def _reply(request_id: int | str | None, code: int, message: str) -> SessionMessage:
    return SessionMessage(JSONRPCError(jsonrpc="2.0", id=request_id, error=ErrorData(code=code, message=message)))


def _surrogate_at(value: Any) -> str | None:
    """Where in `value` the first string (or key) holding a lone surrogate is, as `params.arguments.name`; walked
    in document order with a stack of its own, never by recursion."""
    stack: list[tuple[str, Any, bool]] = [("", value, False)]  # (path, item, whether item is a key)
    while stack:
        path, item, is_key = stack.pop()
        if isinstance(item, str):
            if _lone_surrogate(item):
                return f"the name {path}" if is_key else path
        elif isinstance(item, dict):
            entries: list[tuple[str, Any, bool]] = []
            for key, child in item.items():
                name = (
                    shown(key, 60)
                    if not isinstance(key, str) or _lone_surrogate(key) or not key.isidentifier()
                    else key
                )
                where = f"{path}.{name}" if path else name
                entries += [(where, key, True), (where, child, False)]
            stack.extend(reversed(entries))
        elif isinstance(item, list):
            stack.extend((f"{path}[{index}]", child, False) for index, child in reversed(list(enumerate(item))))
    return None


def _lone_surrogate(text: object) -> bool:
    if not isinstance(text, str):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
