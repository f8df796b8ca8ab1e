"""Every request line over stdio gets a reply, even one the SDK's transport cannot decode.

The SDK's stdio transport (`mcp.server.stdio`) parses each line with pydantic, whose JSON parser refuses a
lone UTF-16 surrogate (`"\\ud800"`: valid JSON syntax, not valid Unicode; a JavaScript client sends it for a
string cut in the middle of an emoji, a Python one for an undecodable file name). The transport hands the
parse error to the server, which logs and drops it, and the client waits for its reply forever.

`AnsweringReadStream` sits between the two: such an error becomes a JSON-RPC error reply to the request's
id (read back with Python's own parser, which accepts the surrogate), naming where the bad text is; a line
that is no JSON at all gets the JSON-RPC parse error, with id null as the specification says.
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any

import anyio
from mcp.shared.message import SessionMessage
from mcp.types import INVALID_PARAMS, INVALID_REQUEST, PARSE_ERROR, ErrorData, JSONRPCError
from pydantic import ValidationError

from axrl_spike_replay.display import shown


class AnsweringReadStream:
    """The transport's read stream, less the lines it could not decode: those are answered on `write_stream`."""

    def __init__(self, inner: Any, write_stream: Any) -> None:
        self._inner = inner
        self._write = write_stream

    @property
    def last_context(self) -> Any:
        """The sender's context of the last item (the SDK's dispatcher reads it when there is one)."""
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        """The next message, or an exception the transport raised that has no request to answer."""
        while True:
            item = await self._inner.receive()
            if isinstance(item, Exception) and (reply := error_reply(item)) is not None:
                await self._write.send(reply)
                continue
            return item

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


def error_reply(exc: Exception) -> SessionMessage | None:
    """The JSON-RPC error that answers the line `exc` (the transport's parse error) was raised for; None when
    there is nothing to answer (a notification, a response, or an error that is not about a line)."""
    if not isinstance(exc, ValidationError):
        return None
    errors = exc.errors(include_url=False)
    line = errors[0].get("input") if errors else None
    if not isinstance(line, (str, bytes)):
        return None
    try:
        doc = json.loads(line)
    except ValueError:
        return _reply(None, PARSE_ERROR, "the line is not JSON")
    if not isinstance(doc, dict) or "method" not in doc:
        return None  # not a request: a response or something else there is no one waiting on
    request_id = doc.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)) or _lone_surrogate(request_id):
        return None  # a notification (no id), or an id that could not be sent back as it came
    where = _surrogate_at(doc)
    if where is None:
        return _reply(request_id, INVALID_REQUEST, "the request is not a valid JSON-RPC message")
    code = INVALID_PARAMS if where.startswith("params") else INVALID_REQUEST
    message = f"{where} holds a lone UTF-16 surrogate: not valid Unicode text; send text as valid UTF-8"
    return _reply(request_id, code, message)


def _reply(request_id: int | str | None, code: int, message: str) -> SessionMessage:
    return SessionMessage(JSONRPCError(jsonrpc="2.0", id=request_id, error=ErrorData(code=code, message=message)))


def _surrogate_at(value: Any, path: str = "") -> str | None:
    """Where in `value` the first string (or key) holding a lone surrogate is, as `params.arguments.name`."""
    if isinstance(value, str):
        return path if _lone_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = shown(key, 60) if _lone_surrogate(key) or not key.isidentifier() else key
            where = f"{path}.{name}" if path else name
            if _lone_surrogate(key):
                return f"the name {where}"
            found = _surrogate_at(item, where)
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _surrogate_at(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _lone_surrogate(text: object) -> bool:
    if not isinstance(text, str):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
