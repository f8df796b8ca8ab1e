"""Dirs, files and sockets only this user can use: the warm service's socket dir, the MCP server's token file.

A private dir is 0700 and this user's; a private file is 0600, this user's, a regular file and not a
symlink. Anything else found in their place is refused by name, never loosened or followed: another
user could have put it there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.files.atomic import atomic_write_text

if TYPE_CHECKING:
    from asyncio.trsock import TransportSocket


def private_dir(path: Path, *, create: bool, purpose: str = "the warm service") -> Path:
    """`path` as a dir only this user can enter (0700), made when `create`; AxrlError for a symlink, a dir owned
    by another user, or (not ours to fix) one others can enter. `purpose` names its use in the messages."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise AxrlError(f"no dir for {purpose} at {path}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise AxrlError(f"{path} is not a plain directory (a symlink?); refusing to use it for {purpose}")
    if st.st_uid != os.getuid():
        raise AxrlError(f"{path} belongs to another user (uid {st.st_uid}); refusing to use it for {purpose}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours: make it private before anything is put in it
    return path


def write_private_text(path: Path, text: str) -> Path:
    """Write `text` to `path` as a 0600 file, atomically (a temp file renamed over it; a symlink there is replaced,
    never written through). The file is never readable by others, not even while it is written."""
    return atomic_write_text(path, text, mode=0o600)


def read_private_text(path: Path, what: str, max_bytes: int) -> str:
    """The UTF-8 text of a file only this user can use: AxrlError (naming `what` and the path) for a symlink, not a
    regular file, another user's file, one that group or others may read or write, an empty one, one over
    `max_bytes`, or one that is not UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AxrlError(f"{what} {path}: no such file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise AxrlError(f"{what} {path} is a symlink; name the file itself") from None
        raise AxrlError(f"{what} {path}: cannot open it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AxrlError(f"{what} {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise AxrlError(f"{what} {path} belongs to another user (uid {st.st_uid}); refusing it")
        if st.st_mode & 0o077:
            raise AxrlError(
                f"{what} {path} can be read or written by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                f"make it private first: chmod 600 {path}"
            )
        if st.st_size == 0:
            raise AxrlError(f"{what} {path} is empty")
        if st.st_size > max_bytes:
            raise AxrlError(f"{what} {path} holds {st.st_size} bytes; at most {max_bytes} are expected")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew meanwhile
        raise AxrlError(f"{what} {path} holds more than {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise AxrlError(f"{what} {path} is not UTF-8 text") from None


def peer_uid(conn: socket.socket | TransportSocket) -> int | None:
    """The user id of the process at the other end of a Unix socket (Linux); None where it cannot be read."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return None
    try:
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i")))
    except OSError:
        return None
    return uid


MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL (Linux)


def bind_private_socket(path: Path) -> socket.socket:
    """A Unix stream socket bound at `path` that only this user can connect to: created 0600, never briefly wider.
    A socket of this user left there (by a server that died) is replaced; anything else there (a file, a dir, a
    symlink, another user's socket) is refused and left alone, and so are a missing parent dir and a path too long
    for a socket (AxrlError naming the path). The caller listens on it and checks each peer with `peer_uid`."""
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise AxrlError(
            f"socket path {path} is {size} bytes; a Unix socket's path holds at most {MAX_SOCKET_PATH_BYTES}: "
            "choose a shorter one"
        )
    if not path.parent.is_dir():
        raise AxrlError(f"cannot create the socket {path}: no directory {path.parent}")
    _remove_stale_socket(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    except OSError as exc:
        listener.close()
        raise AxrlError(f"cannot create the socket {path}: {exc.strerror or exc}") from None
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    return listener


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket of this user at `path`; AxrlError, removing nothing, for anything else there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a symlink" if stat.S_ISLNK(st.st_mode) else "a file"
        raise AxrlError(f"{path} is {kind}, not a socket; refusing to replace it (name a new path for the socket)")
    if st.st_uid != os.getuid():
        raise AxrlError(f"the socket {path} belongs to another user (uid {st.st_uid}); refusing to replace it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
