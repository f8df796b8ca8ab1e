"""Reaching the CLI's warm replay service: find or start it, send a request, stream its progress, get its answer.

`run_on_service` is what `replay`/`sweep`/`attribute --warm` (or `--server SOCKET`) call instead of
running the request here; the answer is the JSON document a cold run's result gives, or the same
error. Nothing here imports torch: a warm call costs a Python start and a socket round trip.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.files.private_files import private_dir
from axrl_spike_replay.investigation.request import ReplayRequest, request_document
from axrl_spike_replay.investigation.warm_socket import (
    Lines,
    WarmPaths,
    check_socket,
    send,
    socket_paths,
    warm_paths,
)

START_TIMEOUT_S = 120.0


class WarmServiceCrash(Exception):
    """The service failed with an unexpected error (not an AxrlError): its traceback, as a cold run would show."""


def _connect(paths: WarmPaths) -> socket.socket | None:
    """A connection to the service at `paths`; None when no service listens there (no socket, or a stale one)."""
    try:
        check_socket(paths.socket)
    except AxrlError:
        if not os.path.lexists(paths.socket):
            return None
        raise  # a socket of another user, a symlink, or too open: refused, never replaced by us
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(paths.socket))
    except (ConnectionRefusedError, FileNotFoundError):
        conn.close()
        return None  # left by a service that died
    return conn


def service_pid(paths: WarmPaths) -> int | None:
    """The pid of the service listening at `paths`; None when none answers."""
    conn = _connect(paths)
    if conn is None:
        return None
    with conn:
        conn.settimeout(10.0)
        try:
            send(conn, {"op": "ping"})
            reply = Lines(conn).next()
        except (OSError, AxrlError):
            return None
    pid = reply.get("pid") if reply else None
    return pid if isinstance(pid, int) else None


def stop_service(paths: WarmPaths, timeout_s: float = 60.0) -> int | None:
    """Ask the service at `paths` to stop and wait until its socket is gone; its pid, or None if none ran."""
    conn = _connect(paths)
    if conn is None:
        return None
    with conn:
        conn.settimeout(10.0)
        send(conn, {"op": "stop"})
        reply = Lines(conn).next()
    deadline = time.monotonic() + timeout_s
    while os.path.lexists(paths.socket) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = reply.get("stopping") if reply else None
    return pid if isinstance(pid, int) else None


def start_service(workspace: Path, paths: WarmPaths) -> None:
    """Start `axrl-spike-replay serve` for `workspace` in the background (its own session, logging to
    `paths.log`) and wait until it answers."""
    private_dir(paths.dir, create=True)
    log = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "axrl_spike_replay", "serve", "--workspace", str(workspace)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # outlives this call; Ctrl-C here does not reach it
        )
    finally:
        os.close(log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if service_pid(paths) is not None:
            return
        if process.poll() is not None and service_pid(paths) is None:
            tail = paths.log.read_text(errors="replace").strip().splitlines()[-3:] if paths.log.exists() else []
            raise AxrlError(f"the warm replay service did not start: {' / '.join(tail) or 'no output'}")
        time.sleep(0.1)
    raise AxrlError(f"the warm replay service did not answer within {START_TIMEOUT_S:g} s (see {paths.log})")


def run_on_service(request: ReplayRequest, server: str | Path | None = None) -> dict[str, Any]:
    """The result document of `request` run by the warm service: the one at socket `server`, else the
    workspace's, started if none runs. Progress lines go to `request.progress`; the run's error is raised
    as the same AxrlError (ConfigError with its parameter) a cold run raises."""
    if not request.runs_here:
        raise ConfigError("`warm` applies to the built-in torch engine run here (no `target`, no `backend` command)")
    cwd = _current_dir()
    workspace = Path(cwd, request.workspace if request.workspace is not None else ".").expanduser().resolve()
    paths = socket_paths(server) if server is not None else warm_paths(workspace)
    for attempt in range(2):
        conn = _connect(paths)
        if conn is None:
            if server is not None:
                raise AxrlError(f"no warm replay service listens at {paths.socket}")
            start_service(workspace, paths)
            conn = _connect(paths)
            if conn is None:
                raise AxrlError(f"the warm replay service at {paths.socket} does not accept connections")
        with conn:
            send(conn, {"op": "run", "cwd": cwd, "request": request_document(request)})
            lines = Lines(conn)
            heard = False
            while (message := lines.next()) is not None:
                heard = True
                if "progress" in message:
                    if request.progress is not None:
                        request.progress(str(message["progress"]))
                    continue
                return _answer(message)
            if heard or attempt == 1 or server is not None:
                raise AxrlError(f"the warm replay service stopped before answering (see {paths.log})")
        time.sleep(0.2)  # it closed without a word: it was stopping (idle) as we came; start a fresh one
    raise AssertionError("unreachable")


def _current_dir() -> str:
    """This process's working directory; AxrlError when it was deleted (the service runs requests there)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise AxrlError(
            "the current directory no longer exists (it was deleted or moved away); cd to an existing directory "
            "and run again"
        ) from None


def _answer(message: dict[str, Any]) -> dict[str, Any]:
    if isinstance(message.get("result"), dict):
        return message["result"]
    if "error" in message:
        parameter = message.get("parameter")
        if message.get("kind") == "config":
            raise ConfigError(str(message["error"]), parameter if isinstance(parameter, str) else None)
        raise AxrlError(str(message["error"]))
    if "crash" in message:
        raise WarmServiceCrash(str(message["crash"]))
    raise AxrlError("the warm replay service gave an answer this version does not know")
