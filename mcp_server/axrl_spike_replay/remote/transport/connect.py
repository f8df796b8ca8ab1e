"""Open an SSH connection to a target: ssh config, jump hosts, keepalives, host keys always verified."""

from __future__ import annotations

import asyncio
import getpass
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.remote.transport.host_keys import (
    HostKeyCheck,
    HostKeyPolicy,
    known_hosts_files,
    system_known_hosts,
)
from axrl_spike_replay.remote.transport.remote_errors import HostKeyError, RemoteError
from axrl_spike_replay.remote.transport.ssh_library import SSHClientConfig, SSHConfig, asyncssh
from axrl_spike_replay.remote.transport.target import SshTarget, parse_target

DEFAULT_KEEPALIVE_INTERVAL = 15.0
DEFAULT_KEEPALIVE_COUNT_MAX = 3
DEFAULT_CONNECT_TIMEOUT = 20.0


@dataclass(frozen=True)
class ConnectSettings:
    """Connection knobs. None means: the target's `-o` option, else the ssh config, else the default here."""

    host_keys: HostKeyPolicy = field(default_factory=HostKeyPolicy)
    keepalive_interval: float | None = None  # seconds between keepalives (ServerAliveInterval), default 15
    keepalive_count_max: int | None = None  # unanswered keepalives before the node counts as dead, default 3
    connect_timeout: float | None = None  # seconds for TCP connect + handshake + authentication, default 20


def connect_settings(known_hosts: str | None = None, accept_new_host_key: bool = False) -> ConnectSettings:
    """Settings with a host-key policy and the default keepalives and timeouts."""
    return ConnectSettings(host_keys=HostKeyPolicy(known_hosts=known_hosts, accept_new=accept_new_host_key))


class _Client(asyncssh.SSHClient):
    """Routes untrusted host keys to the HostKeyCheck and remembers why the connection ended."""

    def __init__(self, check: HostKeyCheck) -> None:
        self.check = check
        self.lost: Exception | None = None
        self.closed = False

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        return self.check.validate(host, addr, port, key)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc
        self.closed = True


@dataclass
class SshConnection:
    """An open connection (plus the jump-host connections it runs through)."""

    conn: asyncssh.SSHClientConnection
    client: _Client
    label: str
    hops: list[SshConnection] = field(default_factory=list)

    @property
    def lost_reason(self) -> str | None:
        """Why the connection ended, when it did."""
        if not self.client.closed:
            return None
        return str(self.client.lost) if self.client.lost else "closed by the node"

    async def close(self) -> None:
        """Close this connection, then its jump hosts."""
        self.conn.close()
        await self.conn.wait_closed()
        for hop in reversed(self.hops):
            await hop.close()


def config_paths(target: SshTarget) -> list[str]:
    """The ssh config files asyncssh reads for `target`: the user's own ~/.ssh/config when readable (a target
    names no other: `-F` is refused by `parse_target`)."""
    default = Path("~/.ssh/config").expanduser()
    return [str(default)] if os.access(default, os.R_OK) else []


def resolve_config(target: SshTarget, paths: list[str]) -> SSHConfig:
    """The ssh config options that apply to `target` (Host/Match blocks evaluated by asyncssh)."""
    try:
        return SSHClientConfig.load(
            None, paths, False, False, False, _local_user(), target.user or (), target.host, target.port or ()
        )
    except (OSError, ValueError) as exc:
        raise RemoteError(f"SSH target {target.spec or target.host!r}: cannot read ssh config: {exc}") from None


async def open_connection(
    target: SshTarget, settings: ConnectSettings | None = None, *, _tunnel: SshConnection | None = None
) -> SshConnection:
    """Connect and authenticate to `target`; RemoteError/HostKeyError with a clear message when that fails."""
    settings = settings or ConnectSettings()
    paths = config_paths(target)
    config = resolve_config(target, paths)
    hops: list[SshConnection] = []
    tunnel = _tunnel
    jump = target.jump if target.jump is not None else config.get("ProxyJump")
    if _tunnel is None and isinstance(jump, str) and jump and jump.lower() != "none":
        for hop_spec in jump.split(","):
            hop_target = parse_target(hop_spec.strip())
            tunnel = await open_connection(hop_target, settings, _tunnel=tunnel)
            hops.append(tunnel)
    files = known_hosts_files(settings.host_keys, target.option("UserKnownHostsFile"), config.get("UserKnownHostsFile"))
    accept_new = settings.host_keys.accept_new or target.option("StrictHostKeyChecking") == "accept-new"
    check = HostKeyCheck(files=files, accept_new=accept_new, system_files=system_known_hosts(files))
    client = _Client(check)
    host = target.option("HostName") or target.host
    label = target.spec or target.label
    kwargs: dict[str, Any] = {
        "port": target.port or (),
        "username": target.user or (),
        "config": paths,
        "known_hosts": check.known,
        "client_factory": lambda: client,
        "keepalive_interval": _pick(
            target.option("ServerAliveInterval"),
            settings.keepalive_interval,
            config.get("ServerAliveInterval"),
            DEFAULT_KEEPALIVE_INTERVAL,
        ),
        "keepalive_count_max": int(
            _pick(
                target.option("ServerAliveCountMax"),
                settings.keepalive_count_max,
                config.get("ServerAliveCountMax"),
                DEFAULT_KEEPALIVE_COUNT_MAX,
            )
        ),
        "connect_timeout": _pick(
            target.option("ConnectTimeout"),
            settings.connect_timeout,
            config.get("ConnectTimeout"),
            DEFAULT_CONNECT_TIMEOUT,
        ),
        "password_auth": False,  # never prompt: keys and agents only
        "kbdint_auth": False,
        "tunnel": tunnel.conn if tunnel is not None else (),
    }
    if target.identity_files:
        kwargs["client_keys"] = [os.path.expanduser(p) for p in target.identity_files]
    if target.option("IdentitiesOnly") == "yes":
        kwargs["agent_path"] = None
    if target.option("HostKeyAlias"):
        kwargs["host_key_alias"] = target.option("HostKeyAlias")
    if target.option("Compression") == "yes":
        kwargs["compression_algs"] = ["zlib@openssh.com", "zlib", "none"]
    try:
        conn = await asyncssh.connect(host, **kwargs)
    except BaseException as exc:
        for hop in reversed(hops):
            await hop.close()
        if isinstance(exc, Exception):
            raise _connect_error(exc, label, check, kwargs["connect_timeout"]) from None
        raise
    return SshConnection(conn=conn, client=client, label=label, hops=hops)


def _pick(*values: object) -> float:
    """The first value set (not None, not ()) as a float: an ssh option (a string or number) or a default."""
    for value in values:
        if value is None or value == ():
            continue
        if isinstance(value, (int, float, str)):
            return float(value)
        raise RemoteError(f"ssh option value {shown(value, 60)} is not a number")
    raise AssertionError("no default")


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _connect_error(exc: Exception, label: str, check: HostKeyCheck, timeout: float) -> RemoteError:
    """A message that says what went wrong and what to try."""
    prefix = f"SSH target {label!r}"
    if isinstance(exc, HostKeyError):
        return exc
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return HostKeyError(f"{prefix}: {check.refused or exc.reason}")
    if isinstance(exc, asyncssh.PermissionDenied):
        return RemoteError(
            f"{prefix}: permission denied ({exc.reason}); the node accepted none of the offered keys. "
            "Give the right key with -i KEY (or IdentityFile in ~/.ssh/config) and check the user name"
        )
    if isinstance(exc, ConnectionRefusedError):
        return RemoteError(f"{prefix}: connection refused; is sshd running there and is the port right?")
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return RemoteError(f"{prefix}: no SSH answer within {timeout:g} s (host down, firewalled or wrong port?)")
    if isinstance(exc, socket.gaierror):
        return RemoteError(f"{prefix}: cannot resolve the host name ({exc.strerror}); is it a Host in ~/.ssh/config?")
    if isinstance(exc, asyncssh.KeyImportError):
        return RemoteError(f"{prefix}: cannot load a private key: {exc}")
    if isinstance(exc, asyncssh.DisconnectError):
        return RemoteError(f"{prefix}: the node closed the connection: {exc.reason}")
    if isinstance(exc, OSError):
        return RemoteError(f"{prefix}: {exc.strerror or exc}")
    if isinstance(exc, ValueError):
        return RemoteError(f"{prefix}: {exc}")
    return RemoteError(f"{prefix}: {type(exc).__name__}: {exc}")
