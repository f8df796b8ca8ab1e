"""The CLI's warm replay service: `axrl-spike-replay serve`, a foreground process later CLI calls reach over a socket.

It keeps what the MCP server keeps (`replay.warm_pool.WarmService`: rank processes with torch, DCP
and the process group up, snapshot weights loaded) and runs each request through `investigation.runs.
run_request`, the function a cold CLI call runs, so result files, task rows and errors are the same.

One request runs at a time, in the main thread, in the caller's working directory (relative paths
mean what they mean to the caller); pings and `--stop` are answered at once. A caller that goes away
cancels its run. The service exits after `idle_s` without a request, on `--stop` or SIGTERM/Ctrl-C,
and takes its rank processes and its socket with it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.investigation.request import ReplayRequest, request_of_document
from axrl_spike_replay.investigation.warm_socket import Lines, WarmPaths, send
from axrl_spike_replay.locks import held_lock
from axrl_spike_replay.private_files import bind_private_socket, peer_uid, private_dir

if TYPE_CHECKING:
    from axrl_spike_replay.replay.warm_pool import WarmService
    from axrl_spike_replay.replay.worker import ConfigOutcome, WorkerJob

_POLL_S = 0.5
_FIRST_MESSAGE_S = 30.0  # a connection that says nothing this long is dropped


@dataclass(frozen=True)
class ServiceSettings:
    """How the service runs: idle time before it exits (and before an unused pool stops), and the weight cache."""

    idle_s: float = 900.0
    memory_bytes: int | None = None  # None: a quarter of RAM (`warm_pool.default_memory_bytes`)


def request_from(doc: Mapping[str, Any], progress: Callable[[str], None], cancel: threading.Event) -> ReplayRequest:
    """The validated request a client sent (`request.request_document`); ConfigError otherwise."""
    request = request_of_document(doc, progress, cancel)
    if not request.runs_here:
        raise ConfigError("the warm service runs the built-in torch engine here; run other targets without it")
    return request


class _Service:
    def __init__(self, paths: WarmPaths, settings: ServiceSettings, say: Callable[[str], None]) -> None:
        from axrl_spike_replay.replay.warm_pool import WarmService

        self.paths, self.settings, self.say = paths, settings, say
        self.warm: WarmService = WarmService(settings.memory_bytes, idle_s=settings.idle_s)
        self.stop = threading.Event()
        self.runs: queue.Queue[tuple[socket.socket, dict[str, Any]]] = queue.Queue()
        self.current: threading.Event | None = None  # the cancel flag of the run in progress
        self.last_active = time.monotonic()
        self.served = 0

    def runner(
        self,
        job: WorkerJob,
        timeout_s: float = 1800.0,
        cancel: threading.Event | None = None,
        *,
        progress: Callable[[str], None] | None = None,
        slot: int = 0,
    ) -> list[ConfigOutcome]:
        # the pools' processes started in another directory: they read the snapshot by its absolute path
        job = replace(job, replay_dir=os.path.abspath(job.replay_dir))
        return self.warm.run_job(job, timeout_s, cancel, progress, slot=slot)

    def accept(self, listener: socket.socket) -> None:
        """Accept connections until stopped; each first message is read in its own short-lived thread."""
        while not self.stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self.greet, args=(conn,), name="warm-conn", daemon=True).start()

    def greet(self, conn: socket.socket) -> None:
        """Read a connection's request: answer a ping or a stop here, queue a run for the main thread."""
        try:
            if peer_uid(conn) not in (None, os.getuid()):
                conn.close()  # the socket is 0600 in a 0700 dir: only a misconfigured system gets here
                return
            conn.settimeout(_FIRST_MESSAGE_S)
            message = Lines(conn).next()
            conn.settimeout(None)
            op = message.get("op") if message else None
            if op == "ping":
                send(conn, {"pid": os.getpid(), "served": self.served, "pools": len(self.warm.pools())})
            elif op == "stop":
                send(conn, {"stopping": os.getpid()})
                self.stop.set()
                if self.current is not None:
                    self.current.set()
            elif op == "run" and message is not None:
                self.runs.put((conn, message))
                return  # the main thread answers and closes it
            else:
                send(conn, {"error": f"unknown request {op!r}"})
        except (OSError, AxrlError):
            pass
        conn.close()

    def loop(self) -> None:
        """Run queued requests until stopped or idle for `idle_s`."""
        while not self.stop.is_set():
            try:
                conn, message = self.runs.get(timeout=_POLL_S)
            except queue.Empty:
                if time.monotonic() - self.last_active > self.settings.idle_s:
                    self.say(f"idle for {self.settings.idle_s:g} s: stopping")
                    return
                continue
            try:
                self.run(conn, message)
            finally:
                conn.close()
                self.last_active = time.monotonic()

    def run(self, conn: socket.socket, message: dict[str, Any]) -> None:
        """Run one request in the caller's directory, streaming its progress lines, then its result or error."""
        from axrl_spike_replay.investigation.runs import run_request
        from axrl_spike_replay.jsonable import to_jsonable

        cancel = self.current = threading.Event()
        threading.Thread(target=_cancel_when_gone, args=(conn, cancel), name="warm-watch", daemon=True).start()

        def progress(line: str) -> None:
            with contextlib.suppress(OSError):
                send(conn, {"progress": line})

        home = os.getcwd()
        try:
            cwd, doc = message.get("cwd"), message.get("request")
            if not isinstance(cwd, str) or not os.path.isabs(cwd) or not isinstance(doc, dict):
                raise ConfigError("a run request needs the caller's absolute `cwd` and the `request` fields")
            os.chdir(cwd)
            request = request_from(doc, progress, cancel)
            self.say(f"{request.what.verb} {request.what.snapshot} (from {cwd})")
            reply: dict[str, Any] = {"result": to_jsonable(run_request(request, self.runner))}
        except AxrlError as exc:
            kind = "config" if isinstance(exc, ConfigError) else "axrl"
            reply = {"error": str(exc), "kind": kind, "parameter": getattr(exc, "parameter", None)}
        except Exception:
            reply = {"crash": traceback.format_exc()}
        finally:
            os.chdir(home)
            self.current = None
        self.served += 1
        with contextlib.suppress(OSError):
            send(conn, reply)


def _cancel_when_gone(conn: socket.socket, cancel: threading.Event) -> None:
    """Set `cancel` when the caller closes its end (it sends nothing after its request)."""
    with contextlib.suppress(OSError, ValueError):
        while conn.recv(1 << 12):
            pass
    cancel.set()


def serve_warm(paths: WarmPaths, settings: ServiceSettings, say: Callable[[str], None]) -> None:
    """Listen on `paths.socket` and run requests until idle, stopped or interrupted; everything it started stops.

    AxrlError when a service already holds these paths. A socket file left by a service that died is replaced.
    """
    from axrl_spike_replay.investigation.warm_client import service_pid

    private_dir(paths.dir, create=True)
    running = service_pid(paths)
    if running is not None:
        raise AxrlError(f"a warm replay service (pid {running}) already listens at {paths.socket}")
    with held_lock(paths.lock, 0, "warm replay service"):
        # the lock is ours: a socket file there was left by a service that died, and is replaced
        listener = bind_private_socket(paths.socket)
        inode = os.stat(paths.socket).st_ino
        listener.listen(16)
        listener.settimeout(_POLL_S)
        service = _Service(paths, settings, say)
        acceptor = threading.Thread(target=service.accept, args=(listener,), name="warm-accept", daemon=True)
        acceptor.start()
        say(f"warm replay service (pid {os.getpid()}) at {paths.socket}; stops after {settings.idle_s:g} s idle")
        try:
            service.loop()
        finally:
            service.stop.set()
            listener.close()
            acceptor.join(timeout=5.0)
            with contextlib.suppress(OSError):
                if os.stat(paths.socket).st_ino == inode:
                    os.unlink(paths.socket)
            service.warm.close()
            say(f"warm replay service stopped after {service.served} request(s)")
