"""Where the CLI's warm replay service listens, who may use it, and how its messages are framed.

The service (`axrl-spike-replay serve`) listens on a Unix socket with the workspace's user-only
permissions: `<workspace>/tmp/spike-replay-warm/serve.sock`, or, when that path is too long for a
socket, `<runtime dir>/axrl-spike-replay-<hash of the workspace>/serve.sock` in this user's runtime dir
(`runtime_dir`): `$XDG_RUNTIME_DIR` when it is a dir of this user that no one else may write, else
`<system temp dir>/axrl-spike-replay-<uid>`, a 0700 dir of this user. Nothing is put under a name in the
shared temp dir that another user could create first, except that runtime dir, which is refused by name
when another user holds it. The dirs are 0700 and the socket 0600; a dir or socket owned by another user,
or a symlink in their place, is refused.

Messages are one JSON object per line, UTF-8, read in linear time up to a cap (`MAX_REQUEST` for what the
service reads, `MAX_REPLY` for what a client reads); a message over its cap, not UTF-8, not JSON or not an
object is a `FrameError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.files.private_files import private_dir
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json

SOCKET_NAME = "serve.sock"
WARM_DIR = Path("tmp") / "spike-replay-warm"
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes; keep a margin
MAX_REQUEST = 1 << 20  # a request names a snapshot and its configs: a sweep of a thousand configs is ~100 KB
MAX_REPLY = 64 << 20  # a sweep's result document is far smaller
_MAX_DEPTH = 64
DEFAULT_SEND_TIMEOUT_S = 30.0  # the service: a client that leaves a reply unread this long counts as gone
_CHUNK = 1 << 16


@dataclass(frozen=True)
class WarmPaths:
    """The service's private dir and the files in it."""

    dir: Path
    name: str = SOCKET_NAME  # the socket's file name in `dir`

    @property
    def socket(self) -> Path:
        return self.dir / self.name

    @property
    def lock(self) -> Path:
        return self.dir / "serve.lock"  # held by the running service for its whole life

    @property
    def log(self) -> Path:
        return self.dir / "serve.log"  # stderr of a service started on first use


def warm_paths(workspace: str | Path) -> WarmPaths:
    """The service dir of a workspace (absolute; the same for every caller of that workspace): inside it, or, for
    a path too long for a socket, in this user's runtime dir (`runtime_dir`, which this may create)."""
    root = Path(workspace).expanduser().resolve()
    inside = root / WARM_DIR
    if len(os.fsencode(inside / SOCKET_NAME)) <= _MAX_SOCKET_PATH:
        return WarmPaths(inside)
    digest = hashlib.sha256(os.fsencode(root)).hexdigest()[:16]
    name = f"axrl-spike-replay-{digest}"
    base = runtime_dir(fits=len(os.fsencode(f"/{name}/{SOCKET_NAME}")))
    return WarmPaths(base / name)


def runtime_dir(fits: int = 0) -> Path:
    """This user's runtime dir, where no other user can create or replace anything: `$XDG_RUNTIME_DIR` when it is
    a dir of this user without group or other write permission and `fits` more bytes still make a socket path; else
    `<system temp dir>/axrl-spike-replay-<uid>`, made 0700 when missing. AxrlError when that one is another user's,
    a symlink or no dir (someone took the name: the message says how to choose another)."""
    given = os.environ.get("XDG_RUNTIME_DIR")
    fitting = given and os.path.isabs(given) and len(os.fsencode(given)) + fits <= _MAX_SOCKET_PATH
    if given and fitting and _own_unshared_dir(Path(given)):
        return Path(given)
    path = Path(tempfile.gettempdir()) / f"axrl-spike-replay-{os.getuid()}"
    try:
        return private_dir(path, create=True, purpose="this user's runtime dir")
    except AxrlError as exc:
        raise AxrlError(
            f"{exc}. Set XDG_RUNTIME_DIR to a dir of your own that only you can write (e.g. mkdir -m 700 "
            "~/.run), or use a workspace with a shorter path"
        ) from None


def _own_unshared_dir(path: Path) -> bool:
    """Whether `path` is a dir of this user that group and others cannot write (so no one else makes names in it)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def socket_paths(socket_path: str | Path) -> WarmPaths:
    """The service dir of an explicit socket path (`--server`)."""
    path = Path(socket_path).expanduser().absolute()
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise AxrlError(f"socket path {path} is longer than a Unix socket path may be ({_MAX_SOCKET_PATH} bytes)")
    return WarmPaths(path.parent, path.name)


def check_socket(path: Path) -> None:
    """AxrlError unless `path` is a socket of this user, not a symlink, that only this user can use."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise AxrlError(f"no warm replay service listens at {path}") from None
    if stat.S_ISLNK(st.st_mode):
        raise AxrlError(f"{path} is a symlink, not the warm service's socket; refusing to connect")
    if not stat.S_ISSOCK(st.st_mode):
        raise AxrlError(f"{path} is not a socket; refusing to connect")
    if st.st_uid != os.getuid():
        raise AxrlError(f"the socket {path} belongs to another user (uid {st.st_uid}); refusing to connect")
    if st.st_mode & 0o077:
        raise AxrlError(f"the socket {path} can be used by other users (mode {st.st_mode & 0o777:o}); refusing it")


class FrameError(AxrlError):
    """A message that cannot be read: over the size cap, not UTF-8, not JSON, or not a JSON object."""


def send(conn: socket.socket, message: dict[str, Any]) -> None:
    """One message: a JSON object on one line (within the socket's timeout, when it has one)."""
    conn.sendall(json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n")


class Lines:
    """Reads the messages of one connection, one JSON object per line, bounded in size (`limit` bytes) and depth.

    The newline is searched for only in bytes not searched before, and the buffer grows in place: a message
    of n bytes costs O(n) time, and at most `limit` plus one chunk is held.
    """

    def __init__(self, conn: socket.socket, limit: int = MAX_REPLY) -> None:
        self.conn = conn
        self.limit = limit
        self.buffer = bytearray()
        self._searched = 0  # bytes of `buffer` known to hold no newline

    def next(self) -> dict[str, Any] | None:
        """The next message; None when the other end closed the connection (a partial message is dropped)."""
        while (end := self.buffer.find(b"\n", self._searched)) < 0:
            self._searched = len(self.buffer)
            if self._searched > self.limit:
                raise FrameError(f"warm service message longer than {_size(self.limit)}")
            chunk = self.conn.recv(_CHUNK)
            if not chunk:
                return None
            self.buffer += chunk
        if end > self.limit:
            raise FrameError(f"warm service message longer than {_size(self.limit)}")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        self._searched = 0
        try:
            doc = parse_untrusted_json(line, _MAX_DEPTH)
        except UntrustedInputError as exc:  # not UTF-8, not JSON, too deep
            raise FrameError(f"warm service message {exc}") from None
        if not isinstance(doc, dict):
            raise FrameError("warm service message is not a JSON object")
        return doc


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 and not limit % (1 << 20) else f"{limit} bytes"
