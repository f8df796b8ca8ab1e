"""Over stdio, one line cannot end the server, and every request line gets its JSON-RPC 2.0 answer: a real server
process reading raw lines (3,000 nested brackets once raised RecursionError and ended it; a message without
`method`, a batch or an object id were dropped, and their client waited forever)."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any

from server_helpers import server_command

GUARD_S = 120.0  # a hang guard: a dropped line never gets a reply; never a measured time
DEEP = "[" * 3000 + "]" * 3000
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
}


def _line(doc: Any) -> str:
    return doc if isinstance(doc, str) else json.dumps(doc)


# (the line sent, the replies it gets as (id, error code); [] for none)
HOSTILE = [
    (DEEP, [(None, -32600)]),  # an array: a batch holding no request
    (
        '{"jsonrpc": "2.0", "id": 11, "method": "tools/call", "params": {"name": "inspect_snapshot", '
        '"arguments": {"snapshot": ' + DEEP + "}}}",
        [(11, -32600)],
    ),
    ({"jsonrpc": "2.0", "id": 12}, [(12, -32600)]),
    (
        [{"jsonrpc": "2.0", "id": 13, "method": "ping"}, {"jsonrpc": "2.0", "id": "14", "method": "ping"}],
        [(13, -32600), ("14", -32600)],
    ),
    ([], [(None, -32600)]),
    ({"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}, [(None, -32600)]),
    ({"jsonrpc": "2.0", "id": None, "method": "ping"}, [(None, -32600)]),
    ({"jsonrpc": "2.0", "id": 1.5, "method": "ping"}, [(None, -32600)]),
    ("{oops", [(None, -32700)]),
    ({"jsonrpc": "2.0", "method": 5}, [(None, -32600)]),
    ({"jsonrpc": "1.0", "id": 15, "method": "ping"}, [(15, -32600)]),
    ({"jsonrpc": "2.0", "id": 16, "method": "ping", "params": 5}, [(16, -32602)]),
    ({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": 5}, []),  # a notification: never answered
    ("", []),  # a blank line carries no message
]


def _reader(stream: Any, lines: queue.Queue[str | None]) -> None:
    for raw in stream:
        lines.put(raw)
    lines.put(None)


def test_hostile_lines_get_their_answers_and_the_server_goes_on(workspace: Path) -> None:
    argv = [*server_command(), "mcp", "--workspace", str(workspace), "--no-warm"]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8"
    )
    assert proc.stdin is not None and proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()

    def send(doc: Any) -> None:
        assert proc.stdin is not None
        proc.stdin.write(_line(doc) + "\n")
        proc.stdin.flush()

    def replies_until(last_id: int) -> list[dict[str, Any]]:
        got = []
        while True:
            raw = lines.get(timeout=GUARD_S)
            assert raw is not None, f"the server ended: {proc.stderr.read() if proc.stderr else ''}"
            got.append(json.loads(raw))
            if got[-1].get("id") == last_id:
                return got

    try:
        send(INITIALIZE)
        assert "result" in replies_until(0)[-1]
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        for line, _ in HOSTILE:
            send(line)
        send({"jsonrpc": "2.0", "id": 99, "method": "ping"})
        got = replies_until(99)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert got[-1] == {"jsonrpc": "2.0", "id": 99, "result": {}}  # still serving, and in order
    errors = got[:-1]
    assert [(r["id"], r["error"]["code"]) for r in errors] == [reply for _, expected in HOSTILE for reply in expected]
    said = [r["error"]["message"] for r in errors]
    assert "deeper than 64 levels" in said[1] and "no `method`" in said[2] and "batches are not served" in said[3]
    assert "`id` must be a string or an integer, not an object" in said[6]
    assert all(len(message) < 400 for message in said)
