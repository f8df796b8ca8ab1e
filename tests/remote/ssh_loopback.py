"""Real SSH servers on 127.0.0.1 for the remote tests: asyncssh's server API, and Debian's OpenSSH sshd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.remote.transport.ssh_library import asyncssh

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


@dataclass
class Keys:
    """A host key pair and a client key pair written to disk."""

    host_key: Path
    host_pub: str
    client_key: Path
    client_pub: str
    authorized_keys: Path

    @classmethod
    def make(cls, directory: Path) -> Keys:
        directory.mkdir(parents=True, exist_ok=True)
        host = asyncssh.generate_private_key("ssh-ed25519")
        client = asyncssh.generate_private_key("ssh-ed25519")
        host_key, client_key = directory / "ssh_host_ed25519_key", directory / "id_ed25519"
        host.write_private_key(str(host_key))
        client.write_private_key(str(client_key))
        os.chmod(host_key, 0o600)
        os.chmod(client_key, 0o600)
        host_pub = host.export_public_key().decode().strip()
        client_pub = client.export_public_key().decode().strip()
        (directory / "id_ed25519.pub").write_text(client_pub + "\n")
        authorized = directory / "authorized_keys"
        authorized.write_text(client_pub + "\n")
        return cls(host_key, host_pub, client_key, client_pub, authorized)


@dataclass
class LoopbackServer:
    """How to reach a running loopback server."""

    kind: str  # "asyncssh" | "openssh"
    port: int
    user: str
    keys: Keys
    known_hosts: Path  # holds the server's real host key

    def spec(self, key: Path | None = None, known_hosts: Path | None = None) -> str:
        """The target as a user would type it (an ssh command line)."""
        kh = known_hosts or self.known_hosts
        return (
            f"ssh -p {self.port} -i {key or self.keys.client_key} -o UserKnownHostsFile={kh} "
            f"-o ConnectTimeout=10 {self.user}@127.0.0.1"
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_known_hosts(path: Path, port: int, host_pub: str) -> Path:
    path.write_text(f"[127.0.0.1]:{port} {host_pub}\n")
    return path


# --- asyncssh server: executes commands for real, like sshd (subprocess with the session's environment) ---


async def _handle_process(process: asyncssh.SSHServerProcess, home: Path) -> None:
    """Run the requested command with `sh -c`, pipe stdin/stdout/stderr, report the exit status."""
    command = process.command
    if command is None:  # an interactive shell is not needed by the product
        process.exit(1)
        return
    env = {**os.environ, **{str(k): str(v) for k, v in (process.env or {}).items()}}
    child = await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=home,
        env=env,
        start_new_session=True,  # sshd gives each session its own session id too
    )

    async def feed_stdin() -> None:
        try:
            while True:
                data = await process.stdin.read(65536)
                if not data:
                    break
                child.stdin.write(data)
                await child.stdin.drain()
        except (asyncssh.Error, OSError, asyncssh.SignalReceived, asyncssh.BreakReceived):
            pass  # signal requests are ignored, as sshd does for root sessions before OpenSSH 9.8
        finally:
            child.stdin.close()

    async def copy(reader: asyncio.StreamReader, writer: asyncssh.SSHWriter) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            with contextlib.suppress(asyncssh.Error, OSError):
                writer.write(data)

    stdin_task = asyncio.ensure_future(feed_stdin())
    await asyncio.gather(copy(child.stdout, process.stdout), copy(child.stderr, process.stderr))
    status = await child.wait()
    stdin_task.cancel()
    with contextlib.suppress(asyncssh.Error, OSError):
        process.exit(status if status >= 0 else 128 - status)


class AsyncsshServer:
    """An asyncssh server on a background event loop (so it outlives each test's own loop)."""

    def __init__(self, directory: Path, keys: Keys) -> None:
        self.directory = directory
        self.keys = keys
        self.home = directory / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _start(self) -> asyncssh.SSHAcceptor:
        home = self.home

        async def factory(process: asyncssh.SSHServerProcess) -> None:
            await _handle_process(process, home)

        return await asyncssh.create_server(
            asyncssh.SSHServer,
            "127.0.0.1",
            0,
            server_host_keys=[str(self.keys.host_key)],
            authorized_client_keys=str(self.keys.authorized_keys),
            process_factory=factory,
            sftp_factory=True,
            encoding=None,
            allow_pty=False,
        )

    def stop(self) -> None:
        self.server.close()
        asyncio.run_coroutine_threadsafe(self.server.wait_closed(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --- OpenSSH sshd with a temporary config ---


class OpenSshServer:
    """Debian's sshd on 127.0.0.1:<free port> with its own host key, authorized key and config."""

    def __init__(self, directory: Path, keys: Keys, prefix: tuple[str, ...] = ()) -> None:
        """`prefix` wraps sshd's command line (e.g. `unshare -m sh -c '...; exec "$@"' sh`: a node with its own
        mounts)."""
        assert SSHD is not None
        self.directory = directory
        self.port = free_port()
        Path("/run/sshd").mkdir(parents=True, exist_ok=True) if os.geteuid() == 0 else None
        config = directory / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {keys.host_key}",
                    f"AuthorizedKeysFile {keys.authorized_keys}",
                    f"PidFile {directory / 'sshd.pid'}",
                    "UsePAM no",
                    "StrictModes no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "Subsystem sftp internal-sftp",
                    "MaxStartups 100",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        self.log = open(directory / "sshd.log", "wb")  # noqa: SIM115 - kept open while the server runs
        argv = [*prefix, SSHD, "-f", str(config), "-D", "-e"]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 15
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {(directory / 'sshd.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    if sock.recv(4).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("sshd did not start listening")
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


class TcpProxy:
    """A TCP relay to a loopback server that a test can freeze (a node that stops answering) or drop."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = threading.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._relay, "127.0.0.1", 0)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    while self.frozen.is_set():
                        await asyncio.sleep(0.05)
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def freeze(self) -> None:
        """Stop relaying: bytes are held, as with a node that hangs or a cable pulled without a reset."""
        self.frozen.set()

    def drop(self) -> None:
        """Close every relayed connection at once."""

        def close_all() -> None:
            for w in self.writers:
                w.transport.abort()

        self.loop.call_soon_threadsafe(close_all)

    def close(self) -> None:
        async def shutdown() -> None:
            for w in self.writers:
                w.transport.abort()
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
