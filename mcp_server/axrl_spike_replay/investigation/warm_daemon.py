"""The CLI's warm replay service: `axrl-spike-replay serve`, a foreground process later CLI calls reach over a socket.

It keeps what the MCP server keeps (`replay.jobs.warm_pool.WarmService`: rank processes with torch, DCP
and the process group up, snapshot weights loaded) and runs each request through `investigation.runs.
run_request`, the function a cold CLI call runs, so result files, task rows and errors are the same.

One request runs at a time, in the main thread, in the caller's working directory (relative paths
mean what they mean to the caller); pings and `--stop` are answered at once. A caller that goes away
cancels its run. The service exits after `idle_s` without a request, on `--stop` or SIGTERM/Ctrl-C,
and takes its rank processes and its socket with it.

It stays reachable whatever its clients do: a message that cannot be read (over `MAX_REQUEST`, not
UTF-8, not JSON) gets an error reply and the connection is closed; a client that leaves a reply unread
for `send_timeout_s` (stopped with SIGSTOP, or hung) counts as gone and its run is cancelled; when file
descriptors run out, accepting backs off and new clients are told so instead of waiting. When its
socket is removed or replaced (say `rm -rf tmp/spike-replay-warm`), no client can reach it any more:
it finishes the request in progress and exits, so a service started afterwards is the only one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.files.locks import held_lock
from axrl_spike_replay.files.private_files import bind_private_socket, peer_uid, private_dir
from axrl_spike_replay.investigation.request import ReplayRequest, request_of_document
from axrl_spike_replay.investigation.warm_socket import (
    DEFAULT_SEND_TIMEOUT_S,
    MAX_REQUEST,
    FrameError,
    Lines,
    WarmPaths,
    send,
)

if TYPE_CHECKING:
    from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
    from axrl_spike_replay.replay.jobs.warm_pool import WarmService

_POLL_S = 0.5
_FIRST_MESSAGE_S = 30.0  # a connection that says nothing this long is dropped
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # descriptors first, then memory
_BACKOFF_S = (0.05, 1.0)  # accept's back-off while descriptors are out: first, then doubling up to this


@dataclass(frozen=True)
class ServiceSettings:
    """How the service runs: idle time before it exits (and before an unused pool stops), and the weight cache."""

    idle_s: float = 900.0
    memory_bytes: int | None = None  # None: a quarter of RAM (`warm_pool.default_memory_bytes`)
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S  # a client that leaves a reply unread this long is gone


def request_from(doc: Mapping[str, Any], progress: Callable[[str], None], cancel: threading.Event) -> ReplayRequest:
    """The validated request a client sent (`request.request_document`); ConfigError otherwise."""
    request = request_of_document(doc, progress, cancel)
    if not request.runs_here:
        raise ConfigError("the warm service runs the built-in torch engine here; run other targets without it")
    return request


class _Service:
    def __init__(self, paths: WarmPaths, settings: ServiceSettings, say: Callable[[str], None]) -> None:
        from axrl_spike_replay.replay.jobs.warm_pool import WarmService

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
        timeout_s: float = RUN_TIMEOUT_S,
        cancel: threading.Event | None = None,
        *,
        progress: Callable[[str], None] | None = None,
        slot: int = 0,
    ) -> list[ConfigOutcome]:
        # the pools' processes started in another directory: they read the snapshot by its absolute path
        job = replace(job, replay_dir=os.path.abspath(job.replay_dir))
        return self.warm.run_job(job, timeout_s, cancel, progress, slot=slot)

    def accept(self, listener: socket.socket, identity: tuple[int, int]) -> None:
        """Accept connections until stopped; each first message is read in its own short-lived thread.

        Out of file descriptors, a spare one is given up to accept the client and tell it so, then accepting
        backs off (doubling up to a second) until descriptors are free again: the thread never gives up. The
        socket file is checked each poll: removed or replaced, the service stops (see the module doc).
        """
        spare: int | None = _spare_fd()
        backoff = 0.0
        while not self.stop.is_set():
            if not _same_file(self.paths.socket, identity):
                self.say(f"the socket {self.paths.socket} was removed or replaced: stopping")
                self.stop.set()  # the run in progress finishes: its client still holds its connection
                break
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.stop.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    break  # the listener was closed: the service is stopping
                short = "out of file descriptors" if exc.errno in _OUT_OF_FDS[:2] else (exc.strerror or str(exc))
                if backoff == 0.0:
                    self.say(f"cannot accept ({short}): waiting clients are told so until it works again")
                if exc.errno in _OUT_OF_FDS and spare is not None:
                    os.close(spare)
                    spare = None
                    self._refuse_one(listener, short)
                    spare = _spare_fd()
                backoff = min(max(backoff * 2, _BACKOFF_S[0]), _BACKOFF_S[1])
                self.stop.wait(backoff)
                continue
            backoff = 0.0
            spare = spare if spare is not None else _spare_fd()
            try:
                threading.Thread(target=self.greet, args=(conn,), name="warm-conn", daemon=True).start()
            except RuntimeError:  # no thread can be started (out of memory or a thread limit)
                conn.close()
        if spare is not None:
            os.close(spare)

    def _refuse_one(self, listener: socket.socket, short: str) -> None:
        """Accept one waiting client on the descriptor just freed and tell it why it cannot be served now."""
        listener.settimeout(0.0)
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        finally:
            listener.settimeout(_POLL_S)
        with conn, contextlib.suppress(OSError):
            conn.settimeout(1.0)
            send(conn, {"error": f"the warm replay service cannot take a connection now ({short}); try again shortly"})

    def greet(self, conn: socket.socket) -> None:
        """Read a connection's request: answer a ping or a stop here, queue a run for the main thread.

        A message that cannot be read gets an error reply and the connection is closed; nothing here raises.
        """
        handed_over = False
        try:
            if peer_uid(conn) not in (None, os.getuid()):
                return  # the socket is 0600 in a 0700 dir: only a misconfigured system gets here
            conn.settimeout(_FIRST_MESSAGE_S)
            try:
                message = Lines(conn, MAX_REQUEST).next()
            except FrameError as exc:
                send(conn, {"error": str(exc), "kind": "frame"})
                return
            conn.settimeout(self.settings.send_timeout_s)  # from here on, only our replies can wait
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
                handed_over = True  # the main thread answers and closes it
            elif message is not None:
                send(conn, {"error": f"unknown request {shown(op, 60)}"})
        except OSError:
            pass  # the client went away, or did not read our reply in time
        except Exception as exc:  # a defect of ours: one line in the log, the connection closed, the service on
            self.say(f"dropped a connection: {type(exc).__name__}: {shown(str(exc), 200, quote=False)}")
        finally:
            if not handed_over:
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
                # shutdown first: it wakes the run's watcher thread blocked in recv (a plain close would not,
                # and the client would see the end of the connection only when that recv timed out)
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
                self.last_active = time.monotonic()

    def run(self, conn: socket.socket, message: dict[str, Any]) -> None:
        """Run one request in the caller's directory, streaming its progress lines, then its result or error.

        A client that leaves a message unread for `send_timeout_s` is gone: its run is cancelled, nothing more is
        sent to it.
        """
        from axrl_spike_replay.investigation.runs import run_request
        from axrl_spike_replay.jsonable import to_jsonable

        cancel = self.current = threading.Event()
        gone: list[str] = []
        threading.Thread(target=_cancel_when_gone, args=(conn, cancel), name="warm-watch", daemon=True).start()

        def reply(doc: dict[str, Any]) -> None:
            if gone:
                return
            try:
                send(conn, doc)
            except TimeoutError:
                gone.append(f"did not read for {self.settings.send_timeout_s:g} s")
            except OSError as exc:
                gone.append(f"went away ({exc.strerror or exc})")
            if gone:
                cancel.set()

        try:
            cwd, doc = message.get("cwd"), message.get("request")
            if not isinstance(cwd, str) or not os.path.isabs(cwd) or not isinstance(doc, dict):
                raise ConfigError("a run request needs the caller's absolute `cwd` and the `request` fields")
            try:
                os.chdir(cwd)
            except OSError as exc:
                raise ConfigError(f"cannot run in the caller's directory {shown(cwd)}: {exc.strerror or exc}") from None
            request = request_from(doc, lambda line: reply({"progress": line}), cancel)
            self.say(f"{request.what.verb} {request.what.snapshot} (from {cwd})")
            answer: dict[str, Any] = {"result": to_jsonable(run_request(request, self.runner))}
        except AxrlError as exc:
            kind = "config" if isinstance(exc, ConfigError) else "axrl"
            answer = {"error": str(exc), "kind": kind, "parameter": getattr(exc, "parameter", None)}
        except Exception:
            answer = {"crash": traceback.format_exc()}
        finally:
            with contextlib.suppress(OSError):
                os.chdir("/")  # hold no caller's directory between requests (it may be deleted)
            self.current = None
        self.served += 1
        during_run = bool(gone)
        reply(answer)
        if gone:
            what = (
                "its run was cancelled" if during_run else "its result was not delivered (the run's files are written)"
            )
            self.say(f"the client {gone[0]}: {what}; connection closed")


def _cancel_when_gone(conn: socket.socket, cancel: threading.Event) -> None:
    """Set `cancel` when the caller closes its end (it sends nothing after its request)."""
    with contextlib.suppress(OSError, ValueError):
        while True:
            try:
                if not conn.recv(1 << 12):
                    break
            except TimeoutError:
                continue  # the connection's timeout bounds our sends; a quiet caller is still there
    cancel.set()


def _spare_fd() -> int | None:
    """A descriptor held in reserve, given up to answer a client when the others run out."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _same_file(path: os.PathLike[str] | str, identity: tuple[int, int]) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell (a transient error): keep serving
    return (st.st_dev, st.st_ino) == identity


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
        st = os.stat(paths.socket)
        identity = (st.st_dev, st.st_ino)
        listener.listen(16)
        listener.settimeout(_POLL_S)
        service = _Service(paths, settings, say)
        os.chdir("/")  # each request runs in its caller's directory; between them, hold none
        acceptor = threading.Thread(target=service.accept, args=(listener, identity), name="warm-accept", daemon=True)
        acceptor.start()
        say(f"warm replay service (pid {os.getpid()}) at {paths.socket}; stops after {settings.idle_s:g} s idle")
        try:
            service.loop()
        finally:
            service.stop.set()
            listener.close()
            acceptor.join(timeout=5.0)
            with contextlib.suppress(OSError):
                if _same_file(paths.socket, identity):
                    os.unlink(paths.socket)
            service.warm.close()
            say(f"warm replay service stopped after {service.served} request(s)")
