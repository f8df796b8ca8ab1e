"""The CLI's warm replay service stays reachable whatever its clients do: a message it cannot read gets an error
reply and a closed connection (no traceback in its log), a 64 MiB message is refused at the cap, running out of
file descriptors does not stop it accepting, a client that stops reading (SIGSTOP) does not hold it, a client in a
deleted directory gets a clear error, and removing its directory stops it instead of leaving it unreachable."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from axrl_spike_replay.investigation.warm_client import service_pid
from axrl_spike_replay.investigation.warm_socket import MAX_REQUEST, WarmPaths, warm_paths

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "mcp_server"
ENV = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT), "OMP_NUM_THREADS": "1"}
GUARD_S = 60.0  # a hang guard for socket reads and process waits, never a measured time


@dataclass
class Service:
    process: subprocess.Popen[bytes]
    paths: WarmPaths
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_service(workspace: Path, *extra: str, nofile: int | None = None) -> Service:
    """`serve` for `workspace` in the background (stderr to a log beside it), once it answers a ping."""
    workspace.mkdir(parents=True, exist_ok=True)
    log = workspace.parent / f"{workspace.name}-serve.log"

    def limit_fds() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    with open(log, "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "axrl_spike_replay", "serve", "--workspace", str(workspace), *extra],
            env=ENV,
            stdin=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=limit_fds,
        )
    paths = warm_paths(workspace)
    deadline = time.monotonic() + GUARD_S
    while service_pid(paths) != process.pid:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return Service(process, paths, log)


def stop(service: Service) -> None:
    if service.process.poll() is None:
        service.process.terminate()
        try:
            service.process.wait(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    # a send timeout past GUARD_S: a connection that ends only when it runs out fails the test instead of waiting
    workspace = tmp_path_factory.mktemp("warm") / "ws"
    running = start_service(workspace, "--warm-idle-timeout", "300", "--send-timeout", "600")
    yield running
    stop(running)


def connect(paths: WarmPaths) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(GUARD_S)
    conn.connect(str(paths.socket))
    return conn


def exchange(paths: WarmPaths, frame: bytes) -> list[bytes]:
    """Send `frame` (from a thread: the service may close before taking all of it), then read until EOF."""
    with connect(paths) as conn:

        def write() -> None:
            with contextlib.suppress(OSError):  # refused part-way (over the cap): the reply is still there to read
                conn.sendall(frame)

        writer = threading.Thread(target=write)
        writer.start()
        received = b""
        try:
            while chunk := conn.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass  # it closed with our unread bytes still queued (over the cap): its reply came first
        writer.join(GUARD_S)
    return received.splitlines()


UNREADABLE = {
    "not UTF-8": (b'{"op": "\xff\xfe"}\n', "is not UTF-8 text"),
    "not JSON": (b'{"op": ping}\n', "is not valid JSON"),
    "an array": (b'["ping"]\n', "is not a JSON object"),
    "too deep": (b'{"op": ' + b"[" * 100 + b"]" * 100 + b"}\n", "nests deeper than"),
    "64 MiB, no newline": (b"{" + b"x" * (64 << 20), "longer than 1 MiB"),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_a_message_it_cannot_read_gets_an_error_reply_and_a_closed_connection(service: Service, case: str) -> None:
    frame, says = UNREADABLE[case]
    replies = exchange(service.paths, frame)
    assert len(replies) == 1, replies[:3]  # one reply, then the service closed the connection
    reply = json.loads(replies[0])
    assert reply["kind"] == "frame" and says in reply["error"], reply
    assert "Traceback" not in service.log_text()
    assert service_pid(service.paths) == service.process.pid


def test_an_unknown_request_is_named_briefly(service: Service) -> None:
    (reply,) = exchange(service.paths, json.dumps({"op": "x" * (MAX_REQUEST // 2)}).encode() + b"\n")
    error = json.loads(reply)["error"]
    assert error.startswith("unknown request 'xxx") and len(error) < 200


def test_a_run_in_a_directory_that_no_longer_exists_is_refused_by_name(service: Service, tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    request = {"op": "run", "cwd": str(gone), "request": {"snapshot": "s"}}
    (reply,) = exchange(service.paths, json.dumps(request).encode() + b"\n")
    answer = json.loads(reply)
    assert answer["kind"] == "config" and f"cannot run in the caller's directory '{gone}'" in answer["error"]
    assert service_pid(service.paths) == service.process.pid


def test_a_client_whose_directory_was_deleted_gets_a_clear_error(service: Service, tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (
        f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
        "from axrl_spike_replay.__main__ import main; sys.exit(main())"
    )
    argv = [sys.executable, "-c", code, "replay", "/no/snapshot", "--server", str(service.paths.socket)]
    done = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=GUARD_S)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "the current directory no longer exists" in done.stderr


def test_running_out_of_file_descriptors_does_not_stop_it_accepting(tmp_path: Path) -> None:
    """Silent clients hold a descriptor each until the service has none left; it tells later clients so, and
    once they go it answers again (the accept thread used to exit for good at the first EMFILE)."""
    running = start_service(tmp_path / "ws", "--warm-idle-timeout", "300", nofile=32)
    held: list[socket.socket] = []
    try:
        while len(held) < 40 and (conn := connect_when_queued(running.paths)) is not None:
            held.append(conn)
        assert len(held) == 40  # accepted, or answered and closed: never left queued for good
        told = 0
        deadline = time.monotonic() + GUARD_S
        while not told:  # clients past the last free descriptor are told so and closed
            assert time.monotonic() < deadline, running.log_text()
            told = sum(b"out of file descriptors" in peek(conn) for conn in held)
            time.sleep(0.1)
        for conn in held:
            conn.close()
        held.clear()
        deadline = time.monotonic() + GUARD_S
        while service_pid(running.paths) != running.process.pid:  # no answer within 10 s is None
            assert time.monotonic() < deadline, running.log_text()
        assert "out of file descriptors" in running.log_text() and "Traceback" not in running.log_text()
    finally:
        for conn in held:
            conn.close()
        stop(running)


def connect_when_queued(paths: WarmPaths, within: float = 10.0) -> socket.socket | None:
    """A connection once the listen backlog has room (it is full while the service accepts nothing); None if it
    stays full for `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.setblocking(False)
        try:
            conn.connect(str(paths.socket))
            return conn
        except BlockingIOError:
            conn.close()
            time.sleep(0.02)
    return None


def peek(conn: socket.socket) -> bytes:
    try:
        return conn.recv(1 << 12, socket.MSG_PEEK)
    except (BlockingIOError, ConnectionResetError):
        return b""


def test_removing_its_directory_stops_it_and_the_next_service_is_the_only_one(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    first = start_service(workspace, "--warm-idle-timeout", "300")
    second: Service | None = None
    try:
        shutil.rmtree(first.paths.dir)
        assert first.process.wait(timeout=GUARD_S) == 0  # it noticed, stopped, and took its processes with it
        assert "was removed or replaced: stopping" in first.log_text()
        second = start_service(workspace, "--warm-idle-timeout", "300")
        assert service_pid(second.paths) == second.process.pid
    finally:
        stop(first)
        if second is not None:
            stop(second)


@pytest.mark.slow  # a warm sweep of 80 configs
def test_a_client_that_stops_reading_does_not_hold_the_service(tmp_path: Path, spike_snapshot: Path) -> None:
    """A sweep's result is larger than the socket buffer: a stopped client used to block the service in send."""
    workspace = tmp_path / "ws"
    running = start_service(workspace, "--warm-idle-timeout", "300", "--send-timeout", "2")
    configs = workspace / "set.yaml"
    configs.write_text(json.dumps([{"advantage_clip": round(0.1 + 0.01 * i, 3)} for i in range(80)]))
    server = ["--server", str(running.paths.socket), "--workspace", str(workspace), "--nproc", "1", "--json"]
    base = [sys.executable, "-m", "axrl_spike_replay"]
    stopped = subprocess.Popen(
        [*base, "sweep", str(spike_snapshot), "--mitigation-set", str(configs), *server],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + GUARD_S
        while "sweep " not in running.log_text():  # the service took the request
            assert time.monotonic() < deadline and stopped.poll() is None, running.log_text()
            time.sleep(0.05)
        stopped.send_signal(signal.SIGSTOP)
        after = subprocess.run(
            [*base, "replay", str(spike_snapshot), *server], env=ENV, capture_output=True, text=True, timeout=300
        )
        assert after.returncode == 0, after.stderr[-2000:]
        assert json.loads(after.stdout)["verdict"] == "reproduced"
        assert "the client did not read for 2 s" in running.log_text()
    finally:
        stopped.send_signal(signal.SIGCONT)
        stopped.kill()
        stopped.wait()
        stop(running)
