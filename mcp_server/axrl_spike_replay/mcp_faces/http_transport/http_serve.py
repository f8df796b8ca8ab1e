"""Serving the MCP server's streamable HTTP app (the SDK's, with its bearer-token middleware) with uvicorn.

Over TCP (`mcp --http`) clients are let in by the bearer token (`http_access`). Over a Unix socket
(`mcp --socket PATH`) the kernel says who the client is: the socket is created 0600, so only this user
(and root) can connect, and each connection's peer user id (SO_PEERCRED) must be this user's, as the
warm replay service checks its callers. uvicorn's own `uds=` would chmod the socket 0666, so the socket
is bound here and handed to uvicorn, whose HTTP/1.1 protocol is given the peer check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.files.private_files import bind_private_socket, peer_uid
from axrl_spike_replay.mcp_faces.http_transport.http_access import bound_security

log = logging.getLogger("axrl_spike_replay.mcp")

# Over a Unix socket the URL's host is a placeholder: clients use http://localhost/mcp.
SOCKET_SECURITY = TransportSecuritySettings(
    enable_dns_rebinding_protection=True,
    allowed_hosts=["localhost", "localhost:*"],
    allowed_origins=["http://localhost", "http://localhost:*"],
)


def http_app(
    server: MCPServer,
    *,
    host: str = "127.0.0.1",
    security: TransportSecuritySettings | None = None,
    on_stop: Callable[[], None] | None = None,
) -> Any:
    """The SDK's streamable HTTP app at /mcp with the Host/Origin checks `security` (None: those of `host`, which the
    SDK makes only for 127.0.0.1, localhost and ::1; serve_tcp passes the bound address's, `bound_security`);
    `on_stop` runs when uvicorn shuts it down, before it re-raises a signal that stopped it (which would end
    the process without running any `finally`)."""
    app = server.streamable_http_app(host=host, transport_security=security)
    if on_stop is not None:
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(running: Any) -> AsyncIterator[Any]:
            try:
                async with inner(running) as state:
                    yield state
            finally:
                on_stop()

        app.router.lifespan_context = lifespan
    return app


def serve_tcp(
    server: MCPServer,
    host: str,
    port: int,
    *,
    ready: Callable[[], None] | None = None,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Serve streamable HTTP on `host:port` until interrupted; `ready` runs once the port is bound (ConfigError,
    before it, when the port cannot be had)."""
    import uvicorn

    listener = _bind_tcp(host, port)
    try:
        if ready is not None:
            ready()
        app = http_app(server, host=host, security=bound_security(host, port), on_stop=on_stop)
        config = uvicorn.Config(app, log_level="warning")
        anyio.run(lambda: uvicorn.Server(config).serve(sockets=[listener]))
    finally:
        listener.close()


def _bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port`, as uvicorn binds one (SO_REUSEADDR); ConfigError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), port))
    except OSError as exc:
        listener.close()
        raise ConfigError(f"cannot listen on {host} port {port}: {exc.strerror or exc}", "port") from None
    return listener


def serve_unix(
    server: MCPServer,
    path: Path,
    *,
    ready: Callable[[], None] | None = None,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Serve streamable HTTP on a Unix socket at `path` until interrupted; only connections from this user are
    served. A socket a live server listens on is refused, one left by a server that died is replaced; the
    socket is removed when the server stops. `ready` runs once it is bound."""
    import uvicorn

    if _answers(path):
        raise ConfigError(f"a server already listens on the socket {path}", "socket")
    listener = bind_private_socket(path)
    inode = os.stat(path).st_ino

    def stopped() -> None:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        if on_stop is not None:
            on_stop()

    try:
        if ready is not None:
            ready()
        app = http_app(server, host="localhost", security=SOCKET_SECURITY, on_stop=stopped)
        config = uvicorn.Config(app, http=_same_user_protocol(), log_level="warning")
        anyio.run(lambda: uvicorn.Server(config).serve(sockets=[listener]))
    finally:
        listener.close()


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket `path`."""
    if not path.is_socket():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _same_user_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol, closing every connection whose peer is another user (SO_PEERCRED)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class SameUserH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            uid = peer_uid(sock) if sock is not None else None
            if uid not in (None, os.getuid()):  # None: no SO_PEERCRED here; the 0600 socket still holds
                log.warning("refused a connection from user id %s on the MCP socket", uid)
                transport.close()

    return SameUserH11Protocol
