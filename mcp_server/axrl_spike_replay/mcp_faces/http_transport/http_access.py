"""Who may use the MCP server over HTTP: whoever holds its bearer token, which stands for "the server's own user".

Every tool runs as the server's user: it reads what that user can read, writes where it can write, runs
replays and reaches SSH targets with its keys. Over stdio the client launched the server, so it is that
user already; over TCP any local user could connect. So HTTP requires a bearer token by default:

- made at start (`secrets`, 256 bits) and, once the server listens, written to `mcp-http-<port>.token` in a
  private state dir (0700, the file 0600; `$XDG_STATE_HOME/axrl-spike-replay`, else
  `~/.local/state/axrl-spike-replay`), removed when the server stops; or read from `--token-file`, which must
  be this user's, private, a regular file (not a symlink), and hold one token of 16 to 1024 visible ASCII
  characters;
- sent by clients as `Authorization: Bearer <token>`, compared in constant time (`hmac.compare_digest`);
  a request without it or with a wrong one gets 401 before any MCP session exists (the SDK's bearer
  middleware, `TokenVerifier`).

`--no-auth` is allowed on a loopback bind only; a non-loopback bind always needs the token.

Whatever the bind, the SDK's Host and Origin checks (DNS rebinding) are on, with the names a client of that bind
uses (`bound_security`): the SDK turns them on by itself only for the exact strings 127.0.0.1, localhost and ::1,
so a server on 127.0.0.2 or [::1] would otherwise answer a page of any origin whose name resolves there.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mcp.server.auth.provider import AccessToken
from mcp.server.transport_security import TransportSecuritySettings

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.files.private_files import private_dir, read_private_text, write_private_text

STATE_SUBDIR = "axrl-spike-replay"
TOKEN_MIN_CHARS = 16
TOKEN_MAX_BYTES = 1024
CLIENT_ID = "axrl-spike-replay-token"  # the one principal a token holder is


def is_loopback(host: str) -> bool:
    """Whether a bind address only this machine can reach: `localhost` or a loopback IP (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def url_host(host: str) -> str:
    """`host` as it stands in a URL or a Host header: an IPv6 address in brackets (given with or without them)."""
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else bare


def bound_names(host: str) -> list[str]:
    """The names a client of a server bound to `host` may put in its Host header (without the port):
    - a loopback address: that address, and `localhost` where it resolves there (127.0.0.1, ::1);
    - `localhost`: itself and 127.0.0.1 (the address it is bound as);
    - a wildcard (0.0.0.0, ::): this machine's loopback names, its host name, fully qualified name and
      their addresses; a client reaching it through another name or address is refused;
    - another address or a host name: itself, and the addresses a host name resolves to."""
    bare = host.strip("[]").lower()
    if bare == "localhost":
        return ["localhost", "127.0.0.1"]
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return _unique([bare, *_addresses(bare)])
    if ip.is_unspecified:
        machine = [socket.gethostname().lower(), socket.getfqdn().lower()]
        loopback = ["localhost", "127.0.0.1", *(["::1"] if ip.version == 6 else [])]
        return _unique([*loopback, *machine, *(a for name in machine for a in _addresses(name))])
    names = [url_host(ip.compressed)]
    if ip in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")):
        names.append("localhost")
    return names


def bound_security(host: str, port: int) -> TransportSecuritySettings:
    """The SDK's Host/Origin checks (DNS rebinding protection) for a server bound to `host:port`: a request is
    served only when its Host header, and its Origin when it sends one, name this server (`bound_names`); others
    get 421 or 403 before any session exists."""
    hosts = [f"{name}:{port}" for name in bound_names(host)]
    if port == 80:  # a client leaves out the default port
        hosts += bound_names(host)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=hosts,
        allowed_origins=[f"http://{h}" for h in hosts],
    )


def _addresses(name: str) -> list[str]:
    """The addresses `name` resolves to here, as a Host header writes them; none when it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return [url_host(str(info[4][0]).split("%")[0]) for info in infos]


def _unique(items: list[str]) -> list[str]:
    return [x for x in dict.fromkeys(items) if x]


def state_dir() -> Path:
    """The per-user dir of the server's token files: `$XDG_STATE_HOME/axrl-spike-replay`, else
    `~/.local/state/axrl-spike-replay` (a stable place, so clients in any shell of this user find it)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser() / STATE_SUBDIR


def default_token_file(port: int) -> Path:
    """Where a server on `port` writes the token it made."""
    return state_dir() / f"mcp-http-{port}.token"


def check_token(text: str, where: str) -> str:
    """The token in `text` (one line; surrounding whitespace dropped); ConfigError naming `where` otherwise."""
    token = text.strip()
    if len(token) < TOKEN_MIN_CHARS:
        raise ConfigError(f"{where}: the token is {len(token)} characters; use at least {TOKEN_MIN_CHARS}")
    if not all("!" <= ch <= "~" for ch in token):
        raise ConfigError(f"{where}: the token must be visible ASCII characters only (no spaces or line breaks)")
    return token


def read_token(path: str | Path) -> str:
    """The token in a token file, checked: this user's, private (no group/other bits), a regular file and not a
    symlink, non-empty, at most 1 KiB, one token of visible ASCII. ConfigError naming the file otherwise."""
    file = Path(path).expanduser()
    try:
        text = read_private_text(file, "`token_file`", TOKEN_MAX_BYTES)
    except AxrlError as exc:  # the same message, as a bad argument
        raise ConfigError(str(exc), "token_file") from None
    return check_token(text, f"`token_file` {file}")


class SharedTokenVerifier:
    """The SDK's `TokenVerifier` for one shared token: the bearer is the server's own user, or no one."""

    def __init__(self, token: str) -> None:
        self._token = token.encode("ascii")

    async def verify_token(self, token: str) -> AccessToken | None:
        """The access of a bearer whose token matches, compared in constant time; None for any other token."""
        # bytes, not str: compare_digest refuses non-ASCII str, and a header may hold anything
        offered = token.encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(offered, self._token):
            return None
        return AccessToken(token=token, client_id=CLIENT_ID, scopes=[])


@dataclass
class HttpAccess:
    """How HTTP clients are let in: with `token` (None: no token asked), kept in `token_file`. A token the server
    made is written there by `publish`, once the server listens (a second server on a busy port must not replace
    the first one's token), and removed by `close` (`written`: the file's inode and device, so a file another
    server wrote meanwhile stays)."""

    token: str | None
    token_file: Path | None = None
    made: bool = False
    written: tuple[int, int] | None = None

    def verifier(self) -> SharedTokenVerifier | None:
        """The SDK token verifier, or None when no token is required."""
        return SharedTokenVerifier(self.token) if self.token is not None else None

    def publish(self) -> None:
        """Write a token the server made to its file (0600 in a 0700 dir); nothing for a given or no token."""
        if not self.made or self.token is None or self.token_file is None or self.written is not None:
            return
        try:
            private_dir(self.token_file.parent, create=True, purpose="the MCP server's token files")
        except (AxrlError, OSError) as exc:
            raise ConfigError(
                f"cannot keep the MCP server's token in {self.token_file.parent} ({exc}); name a private file "
                "with `token_file`",
                "token_file",
            ) from None
        write_private_text(self.token_file, self.token + "\n")
        st = os.stat(self.token_file)
        self.written = (st.st_ino, st.st_dev)

    def close(self) -> None:
        """Remove the token file the server wrote (idempotent); a file given with `token_file` stays."""
        if self.written is None or self.token_file is None:
            return
        with contextlib.suppress(OSError):
            now = os.stat(self.token_file)
            if (now.st_ino, now.st_dev) == self.written:
                os.unlink(self.token_file)
        self.written = None


def check_bind(host: str, *, no_auth: bool, token_file: str | None) -> None:
    """ConfigError for a combination that would let other users in: `--no-auth` on a non-loopback bind, or
    `--no-auth` with `--token-file`."""
    if no_auth and token_file is not None:
        raise ConfigError("`no_auth` and `token_file` contradict each other: give one of them", "no_auth")
    if no_auth and not is_loopback(host):
        raise ConfigError(
            f"`no_auth` is refused with `host` {host}: it is not a loopback address, so other machines could call "
            "every tool as this user. Serve it with the token (the default), or bind 127.0.0.1 and reach it "
            "through an SSH tunnel.",
            "no_auth",
        )


@contextlib.contextmanager
def http_access(port: int, *, no_auth: bool = False, token_file: str | None = None) -> Iterator[HttpAccess]:
    """The access of a server on `port` for as long as the block runs: no token with `no_auth`; the token of
    `token_file`; else a new token, for `default_token_file(port)` (written by `publish`, removed afterwards)."""
    if no_auth:
        yield HttpAccess(token=None)
        return
    if token_file is not None:
        path = Path(token_file).expanduser().absolute()
        yield HttpAccess(token=read_token(path), token_file=path)
        return
    access = HttpAccess(token=secrets.token_urlsafe(32), token_file=default_token_file(port), made=True)
    try:
        yield access
    finally:
        access.close()


def bearer_headers(token: str) -> dict[str, str]:
    """The HTTP headers a client sends: `{"Authorization": "Bearer <token>"}`."""
    return {"Authorization": f"Bearer {token}"}
