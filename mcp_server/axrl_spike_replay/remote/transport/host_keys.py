"""Host-key verification against known_hosts: unknown keys refused or (opt-in) recorded, changed keys refused."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from axrl_spike_replay.files.atomic import atomic_write_text
from axrl_spike_replay.files.locks import held_lock
from axrl_spike_replay.remote.transport.remote_errors import HostKeyError
from axrl_spike_replay.remote.transport.ssh_library import asyncssh

DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
GLOBAL_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
DEFAULT_SSH_PORT = 22


@dataclass(frozen=True)
class HostKeyPolicy:
    """How host keys are checked. Checking itself is always on."""

    known_hosts: str | None = None  # the file to check and record in; None: ssh config, else ~/.ssh/known_hosts
    accept_new: bool = False  # record the key of a host not yet in known_hosts (OpenSSH's accept-new)


def fingerprint(key: asyncssh.SSHKey) -> str:
    """`SHA256:...` fingerprint, as `ssh-keygen -lf` prints it."""
    return key.get_fingerprint("sha256")


def known_hosts_pattern(host: str, port: int | None) -> str:
    """The host field of a known_hosts line: `host`, or `[host]:port` for a port other than 22."""
    if port and port != DEFAULT_SSH_PORT:
        return f"[{host}]:{port}"
    return host


def known_hosts_line(host: str, port: int | None, key: asyncssh.SSHKey) -> str:
    """One known_hosts line for `key` (no trailing newline)."""
    return f"{known_hosts_pattern(host, port)} {key.export_public_key('openssh').decode('ascii').strip()}"


def record_host_key(path: Path, host: str, port: int | None, key: asyncssh.SSHKey) -> None:
    """Append `key` for host/port to known_hosts `path` atomically (lock, read, write temp, rename)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # like ~/.ssh
    if path.exists() and not path.is_file():
        raise HostKeyError(f"known_hosts {path} is not a regular file; cannot record the key of {host}")
    with held_lock(str(path) + ".lock", 30, f"known_hosts {path}"):
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
        if old and not old.endswith("\n"):
            old += "\n"
        atomic_write_text(path, old + known_hosts_line(host, port, key) + "\n")
        os.chmod(path, mode)


@dataclass
class HostKeyCheck:
    """The host-key decision for one connection; asyncssh asks it about keys known_hosts does not trust."""

    files: list[Path]  # the user's known_hosts files; the first one is where new keys are recorded
    accept_new: bool
    system_files: list[Path] = field(default_factory=list)  # also trusted, never written (ssh_known_hosts)
    known: asyncssh.SSHKnownHosts = field(init=False)
    refused: str | None = None  # why, when a key was refused
    recorded: str | None = None  # the line written, when a new key was accepted

    def __post_init__(self) -> None:
        existing = [str(p) for p in [*self.files, *self.system_files] if p.is_file()]
        try:
            self.known = asyncssh.read_known_hosts(existing) if existing else asyncssh.SSHKnownHosts()
        except (OSError, ValueError) as exc:
            raise HostKeyError(f"cannot read known_hosts {', '.join(existing)}: {exc}") from None

    @property
    def record_file(self) -> Path:
        return self.files[0]

    def validate(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        """Called for a key that known_hosts does not trust: record it (new host, opted in) or refuse it."""
        port_or_none = port if port != DEFAULT_SSH_PORT else None
        trusted = self.known.match(host, addr, port_or_none)
        has_entries = bool(trusted[0] or trusted[1])
        where = known_hosts_pattern(host, port)
        if has_entries:
            recorded = ", ".join(sorted({fingerprint(k) for k in trusted[0]})) or "a certificate authority"
            self.refused = (
                f"HOST KEY CHANGED for {where}: it presented {key.get_algorithm()} key {fingerprint(key)}, "
                f"but known_hosts ({', '.join(str(p) for p in self.files)}) holds {recorded}. "
                "Someone may be intercepting the connection, or the node was reinstalled. Check the new "
                f"fingerprint with the node's administrator, then remove the old entry (ssh-keygen -R '{where}')."
            )
            return False
        if not self.accept_new:
            self.refused = (
                f"host {where} is not in known_hosts ({', '.join(str(p) for p in self.files)}); it presented "
                f"{key.get_algorithm()} key {fingerprint(key)}. Verify it, then connect once with "
                "`accept_new_host_key` (or ssh to it yourself) to record it."
            )
            return False
        try:
            record_host_key(self.record_file, host, port, key)
        except (HostKeyError, OSError) as exc:
            self.refused = f"new host {where} ({fingerprint(key)}) could not be recorded: {exc}"
            return False
        self.recorded = known_hosts_line(host, port, key)
        return True


def known_hosts_files(policy: HostKeyPolicy, option_value: str | None, config_value: object) -> list[Path]:
    """Files to check: --known-hosts, else `-o UserKnownHostsFile`, else the ssh config's, else the default."""
    if policy.known_hosts:
        names: list[str] = [policy.known_hosts]
    elif option_value:
        names = option_value.split()
    elif isinstance(config_value, (list, tuple)) and config_value:
        names = [str(v) for v in config_value]
    else:
        names = [str(DEFAULT_KNOWN_HOSTS)]
    for name in names:
        if name.lower() in ("none", "/dev/null"):
            raise HostKeyError(
                f"UserKnownHostsFile {name} would turn host-key checking off, which is not allowed; "
                "pass `known_hosts` (a file) to use another one"
            )
    return [Path(os.path.expanduser(n)) for n in names]


def system_known_hosts(files: list[Path]) -> list[Path]:
    """The system-wide known_hosts when readable and not already among `files`."""
    readable = os.access(GLOBAL_KNOWN_HOSTS, os.R_OK)
    return [GLOBAL_KNOWN_HOSTS] if readable and GLOBAL_KNOWN_HOSTS not in files else []
