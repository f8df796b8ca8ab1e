"""What other programs hand us on the newer surfaces — a replay command's result file and output, a warm-service
client's frames, an MCP client's lines, a logs dir's entries: a result or a clear, bounded refusal, in bounded
memory, never another exception and never a wait on a writer that does not come."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import threading
from pathlib import Path

import pytest
from hostile_helpers import MAX_MESSAGE
from hostile_strategies import hostile_scalars, hostile_values
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from axrl_spike_replay.errors import AxrlError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RESULT_KEYS = ["grad_norm", "fidelity", "device", "world_size_used", "top_params", "tolerance", "extra"]


def _clear(message: str) -> None:
    assert len(message) <= MAX_MESSAGE, len(message)
    assert "\x1b" not in message and "\x00" not in message and "Traceback" not in message


def _json_bytes(doc: object) -> bytes | None:
    try:
        return json.dumps(doc).encode()
    except (ValueError, TypeError):  # an integer too long for str(): json cannot write it either
        return None


@FUZZ
@given(
    doc=st.one_of(
        hostile_values,
        st.dictionaries(st.sampled_from(RESULT_KEYS), hostile_values, max_size=6),
        st.fixed_dictionaries({"grad_norm": hostile_scalars, "top_params": hostile_values}),
    )
)
@example(doc={"grad_norm": 1.0, "tolerance": 1e9})
@example(doc={"grad_norm": "nan", "top_params": [{"name": "w", "grad_norm": "-inf"}]})
def test_a_command_result_file_is_read_or_refused_by_field(tmp_path_factory: pytest.TempPathFactory, doc) -> None:
    from axrl_spike_replay.remote.command.command_result import read_command_result

    data = _json_bytes(doc)
    if data is None:
        return
    path = tmp_path_factory.mktemp("result") / "replay_result.json"
    path.write_bytes(data)
    try:
        report = read_command_result(path, "node:/out/replay_result.json")
    except AxrlError as exc:
        _clear(str(exc))
        assert str(exc).startswith("node:/out/replay_result.json") or "fidelity" in str(exc)
        return
    assert report.grad_norm is None or isinstance(report.grad_norm, float)
    assert all(set(entry) == {"name", "grad_norm"} for entry in report.top_params)
    assert "tolerance" not in {f for f in vars(report)}  # never carried into the verdict


class _Chunks:
    """A process's output stream as the pump sees it: the given chunks, then EOF."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def read(self, n: int = -1, /) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


@FUZZ
@given(
    pieces=st.lists(st.one_of(st.binary(max_size=70), st.sampled_from([b"\n", b"\n\n", b"x" * 200])), max_size=20),
    cut=st.integers(min_value=1, max_value=64),
)
def test_output_lines_are_capped_with_a_marker_however_the_bytes_arrive(pieces: list[bytes], cut: int) -> None:
    """Against the obvious reference (split the whole output, cap each line), with a 16-byte cap."""
    from axrl_spike_replay.remote.transport import job

    data = b"".join(pieces)
    chunks = [data[i : i + cut] for i in range(0, len(data), cut)]
    sink, echoed = io.BytesIO(), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(job, "MAX_LINE_BYTES", 16)
        asyncio.run(job.pump_lines(_Chunks(chunks), sink, "stdout", lambda _s, line: echoed.append(line)))

    def capped(line: bytes) -> bytes:
        return line if len(line) <= 16 else line[:16] + job.TRUNCATED_MARK % (len(line) - 16)

    *lines, last = data.split(b"\n")
    expected = b"".join(capped(line) + b"\n" for line in lines) + (capped(last) if last else b"")
    assert sink.getvalue() == expected
    assert echoed == [capped(line).decode("utf-8", "replace") for line in lines] + (
        [capped(last).decode("utf-8", "replace")] if last else []
    )


@FUZZ
@given(
    frame=st.one_of(
        st.binary(max_size=300),
        hostile_values.map(lambda v: (_json_bytes(v) or b"0") + b"\n"),
        st.sampled_from([b"\xff\xfe\n", b"[" * 200 + b"\n", b"{" + b"x" * 5000, b'{"op": "ping"}\n{"op"']),
    ),
    cut=st.integers(min_value=1, max_value=512),
)
def test_a_warm_service_frame_is_a_message_or_a_frame_error(frame: bytes, cut: int) -> None:
    from axrl_spike_replay.investigation.warm_socket import FrameError, Lines

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(30)

        def write() -> None:
            with contextlib.suppress(OSError):  # the reader may stop early (over its cap, or a whole message read)
                for i in range(0, len(frame), cut):
                    theirs.sendall(frame[i : i + cut])
                theirs.shutdown(socket.SHUT_WR)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            message = Lines(ours, limit=1024).next()
            assert message is None or isinstance(message, dict)
        except FrameError as exc:
            _clear(str(exc))
        finally:
            ours.shutdown(socket.SHUT_RD)
            writer.join(30)


lone_surrogates = st.sampled_from(["\ud800", "\udcff", "\udfff", "a\ud83d", "\ude00b"])


@FUZZ
@given(
    arguments=st.dictionaries(
        st.one_of(st.text(max_size=8), lone_surrogates),
        st.one_of(hostile_values, lone_surrogates, st.lists(lone_surrogates, max_size=3)),
        max_size=4,
    ),
    request_id=st.one_of(st.integers(min_value=-(2**31), max_value=2**31), st.text(max_size=8), lone_surrogates),
)
def test_an_mcp_line_the_transport_cannot_decode_gets_a_reply_that_can_be_sent(arguments, request_id) -> None:
    from mcp.types import jsonrpc_message_adapter

    from axrl_spike_replay.mcp_faces.stdio_replies import replies_to

    message = {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "x", "arguments": arguments},
    }
    line = _json_bytes(message)
    if line is None:
        return
    try:
        jsonrpc_message_adapter.validate_json(line, by_name=False)
        return  # the transport decodes it: the server answers as for any request
    except ValueError as exc:
        replies = replies_to(line, exc)
    assert replies is not None and len(replies) == 1  # every such request is answered, once
    text = replies[0].message.model_dump_json(by_alias=True, exclude_unset=True)  # what the transport writes
    doc = json.loads(text)
    sendable = True
    if isinstance(request_id, str):
        try:
            request_id.encode("utf-8")
        except UnicodeEncodeError:
            sendable = False
    # answered to its id; an id that cannot be sent back as it came (a lone surrogate) gets null, as JSON-RPC says
    assert doc["id"] == (request_id if sendable else None)
    assert doc["error"]["code"] in (-32602, -32600)
    _clear(doc["error"]["message"])


ENTRY_KINDS = ["log", "fifo", "dir named .log", "symlink out", "broken symlink", "empty log", "socket"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(ENTRY_KINDS), min_size=1, max_size=8))
def test_a_logs_dir_of_any_entries_is_read_or_refused_without_waiting(
    tmp_path_factory: pytest.TempPathFactory, kinds: list[str]
) -> None:
    from axrl_spike_replay.diagnosis.evidence.log_scan import scan_logs

    root = tmp_path_factory.mktemp("logs")
    out, outside = root / "run1~job__actor", root / "outside.log"
    (out / "logs").mkdir(parents=True)
    outside.write_text(" iteration 1/ 10 | grad norm: 9.0 | loss: 1.0 |\n")
    listeners = []
    for index, kind in enumerate(kinds):
        entry = out / "logs" / f"e{index}.log"
        if kind == "log":
            entry.write_text(f" iteration {index + 1}/ 10 | grad norm: 1.0 | loss: 1.0 |\n")
        elif kind == "empty log":
            entry.write_text("")
        elif kind == "fifo":
            os.mkfifo(entry)
        elif kind == "dir named .log":
            entry.mkdir()
        elif kind == "symlink out":
            entry.symlink_to(outside)
        elif kind == "broken symlink":
            entry.symlink_to(root / "missing.log")
        else:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(entry))
            listeners.append(listener)
    outcome: list[object] = []

    def scan() -> None:
        try:
            outcome.append(scan_logs([out], root / "copies"))
        except AxrlError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=scan, daemon=True)
    reader.start()
    reader.join(120)
    try:
        assert not reader.is_alive(), "the scan waited on an entry"
        (result,) = outcome
        if isinstance(result, AxrlError):
            _clear(str(result))
            assert not any(kind in ("log", "empty log") for kind in kinds)
            return
        read = {Path(p).name for p in result.copied}  # type: ignore[attr-defined]
        assert read == {f"e{i}.log" for i, kind in enumerate(kinds) if kind in ("log", "empty log")}
        reasons = {Path(s["path"]).name: s["reason"] for s in result.skipped}  # type: ignore[attr-defined]
        for index, kind in enumerate(kinds):
            if kind in ("fifo", "socket", "symlink out"):
                assert f"e{index}.log" in reasons, (kind, reasons)
    finally:
        for listener in listeners:
            listener.close()
