"""A real `axrl-spike-replay mcp --http` (or `--socket`) server process, and the clients the HTTP tests use: the SDK's
streamable HTTP client with or without the bearer header, and raw HTTP requests (urllib, or curl as another user)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import anyio
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from server_helpers import server_command

T = TypeVar("T")
MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
}


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A JSON-RPC `tools/call` request body."""
    return {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


@dataclass
class HttpServer:
    """A running server process: its URL (or socket), the token file it made (None with --no-auth / a socket)."""

    proc: subprocess.Popen[str]
    url: str
    token_file: Path | None
    socket: Path | None = None

    @property
    def token(self) -> str:
        assert self.token_file is not None
        return self.token_file.read_text().strip()

    def stderr(self) -> str:
        """What the server printed (only once it has stopped)."""
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen[str], what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stderr.read() if proc.stderr else ''}")
        if ready():
            return
        time.sleep(0.1)
    raise AssertionError(f"the server never got {what}")


def _listens(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=0.5):
            return True
    except OSError:
        return False


def _accepts(path: Path) -> bool:
    """Whether the server listens on the Unix socket `path`: it sets the socket's mode before it listens, so a test
    that changes the mode after this sees its own change stay."""
    if not path.is_socket():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def server_env(state: Path) -> dict[str, str]:
    """The server's environment: its token files under `state` (not the user's ~/.local/state)."""
    return {**os.environ, "XDG_STATE_HOME": str(state)}


@contextmanager
def http_server(
    workspace: Path, state: Path, *args: str, socket_path: Path | None = None, host: str = "127.0.0.1"
) -> Iterator[HttpServer]:
    """`mcp --http` on a free port of the loopback address `host` (or `mcp --socket PATH`) with `args`, stopped
    (SIGTERM) afterwards."""
    if socket_path is None:
        port = free_port()
        where = ["--http", "--port", str(port), *(["--host", host] if host != "127.0.0.1" else [])]
    else:
        port = 0
        where = ["--socket", str(socket_path)]
    cmd = [*server_command(), "mcp", *where, "--workspace", str(workspace), "--no-warm", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=server_env(state))
    try:
        if socket_path is None:
            _wait_until(lambda: _listens(port, host), proc, f"to listen on {host}:{port}")
            token_file = None if "--no-auth" in args else state / "axrl-spike-replay" / f"mcp-http-{port}.token"
            bare = host.strip("[]")
            yield HttpServer(proc, f"http://{f'[{bare}]' if ':' in bare else bare}:{port}/mcp", token_file)
        else:
            _wait_until(lambda: _accepts(socket_path), proc, f"to listen on {socket_path}")
            yield HttpServer(proc, "http://localhost/mcp", None, socket_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def raw_post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """POST one JSON-RPC message as any HTTP client would: (status, response headers, body)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={**MCP_HEADERS, **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def with_http_client(
    url: str, body: Callable[[Client], Awaitable[T]], headers: dict[str, str] | None = None, uds: Path | None = None
) -> T:
    """Run `body(client)` with the SDK's streamable HTTP client sending `headers` (over the Unix socket `uds`)."""

    async def main() -> T:
        transport = httpx2.AsyncHTTPTransport(uds=str(uds)) if uds is not None else None
        timeout = httpx2.Timeout(30.0, read=300.0)
        async with (
            httpx2.AsyncClient(headers=headers, timeout=timeout, transport=transport) as http,
            Client(streamable_http_client(url, http_client=http)) as client,
        ):
            return await body(client)

    return anyio.run(main)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def as_nobody() -> list[str] | None:
    """The command prefix that runs a command as the unprivileged user `nobody`; None where that cannot be done."""
    if os.getuid() != 0 or shutil.which("runuser") is None:
        return None
    try:
        subprocess.run(["runuser", "-u", "nobody", "--", "true"], check=True, capture_output=True, timeout=30)
    except (subprocess.SubprocessError, OSError):
        return None
    return ["runuser", "-u", "nobody", "--"]


def refused_start(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`axrl-spike-replay mcp ARGS` for a start that must be refused: run in this process (the same `main` as the
    console script, without starting Python again), with `env` as the environment. Should it get as far as serving,
    the test fails there instead of hanging on a server that listens."""
    import axrl_spike_replay.server
    from axrl_spike_replay.cli import main

    def serve(*_: object, **__: object) -> None:
        raise AssertionError(f"`mcp {' '.join(args)}` was not refused: it went on to serve")

    out, err = io.StringIO(), io.StringIO()
    term = signal.getsignal(signal.SIGTERM)  # the mcp verb sets SIGTERM's disposition for the server it starts
    try:
        with (
            mock.patch.dict(os.environ, env if env is not None else {}, clear=env is not None),
            mock.patch.object(axrl_spike_replay.server, "serve", serve),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                code = main(["mcp", *args])
            except SystemExit as exc:  # argparse's refusals
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        signal.signal(signal.SIGTERM, term)
    return subprocess.CompletedProcess(["mcp", *args], code, out.getvalue(), err.getvalue())
