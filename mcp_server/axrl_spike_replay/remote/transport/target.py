"""SSH targets as people type them: an `ssh ...` command line, `user@host:port`, `ssh://...` or a config alias.

A target names where to connect and as whom, never a command to run on this machine: the `-o` options are an
allow-list without ProxyCommand, LocalCommand or KnownHostsCommand, and `-F FILE` is refused, because an ssh config
file can hold those and `Match exec`, which runs while the file is read. The user's own `~/.ssh/config` is read as
ssh reads it: Host blocks there (or files it `Include`s) are how a target gets settings beyond the allow-list.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace

from axrl_spike_replay.errors import ConfigError

# `ssh` flags a target may carry. Flags taking a value, then harmless flags without one.
_VALUE_FLAGS = {
    "p": "port",
    "i": "identity file",
    "l": "login name",
    "J": "jump host",
    "o": "option",
}
_PLAIN_FLAGS = set("46CqTv")
_REFUSED_HINTS = {
    "L": "port forwarding",
    "R": "port forwarding",
    "D": "port forwarding",
    "W": "stdio forwarding",
    "N": "no remote command",
    "f": "backgrounding",
    "t": "a terminal",
    "A": "agent forwarding",
    "X": "X11 forwarding",
    "Y": "X11 forwarding",
    "M": "connection sharing",
    "S": "connection sharing",
    "O": "connection sharing",
}
_CONFIG_FILE_REFUSED = (
    "-F (an ssh config file) is refused: a config file can run commands on this machine (ProxyCommand, "
    "LocalCommand, Match exec), which a target may not. Put its Host block in ~/.ssh/config (or `Include` the file "
    "there) and name the Host, or give -p, -i, -l, -J and -o Key=Value"
)

# `-o Key=Value` options understood, by lower-case name -> canonical name (as in ssh_config(5)).
_OPTIONS = {
    name.lower(): name
    for name in (
        "BatchMode",
        "Compression",
        "ConnectTimeout",
        "HostKeyAlias",
        "HostName",
        "IdentitiesOnly",
        "IdentityFile",
        "LogLevel",
        "Port",
        "ProxyJump",
        "ServerAliveCountMax",
        "ServerAliveInterval",
        "StrictHostKeyChecking",
        "User",
        "UserKnownHostsFile",
    )
}
_INT_OPTIONS = {"ConnectTimeout", "ServerAliveCountMax", "ServerAliveInterval"}
_BOOL_OPTIONS = {"BatchMode", "Compression", "IdentitiesOnly"}
_OPTION_RE = re.compile(r"^\s*([A-Za-z]+)\s*(?:=|\s)\s*(.*)$")
_STRICT_VALUES = {"yes": "yes", "ask": "yes", "accept-new": "accept-new"}


@dataclass(frozen=True)
class SshTarget:
    """Where and how to connect. `host` may be a name, an address or a Host alias of the ssh config."""

    host: str
    user: str | None = None
    port: int | None = None
    identity_files: tuple[str, ...] = ()
    jump: str | None = None  # ProxyJump: [user@]host[:port][,...]
    options: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # other -o options, canonical names
    spec: str = ""  # the target as given

    def option(self, name: str) -> str | None:
        """Value of a `-o` option (canonical name), else None."""
        return dict(self.options).get(name)

    @property
    def label(self) -> str:
        """`user@host:port` as far as known before the ssh config is read."""
        text = self.host if ":" not in self.host else f"[{self.host}]"
        if self.user:
            text = f"{self.user}@{text}"
        return f"{text}:{self.port}" if self.port else text


def parse_target(spec: str) -> SshTarget:
    """Parse `ssh [-p PORT] [-i KEY] [-l USER] [-J JUMP] [-o K=V] dest`, `ssh://...`, `[user@]host[:port]`;
    ConfigError naming what is refused (`-F`, forwarding, options outside the allow-list, checking turned off)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("SSH target is empty; give e.g. 'ssh -p 2222 user@host', 'user@host:2222' or a Host alias")
    text = spec.strip()
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"SSH target {spec!r}: cannot split it like a shell would ({exc})") from None
    is_ssh = words[0] in ("ssh", "/usr/bin/ssh")
    if is_ssh or len(words) > 1 or text.startswith("-"):
        if is_ssh:
            words = words[1:]
        target = _parse_command_line(words, spec)
    else:
        target = _parse_destination(words[0], spec)
    return replace(target, spec=text)


def _parse_command_line(words: list[str], spec: str) -> SshTarget:
    values: dict[str, list[str]] = {"p": [], "i": [], "l": [], "J": [], "o": []}
    destination: str | None = None
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if word == "--":
            rest, index = words[index:], len(words)
            if destination is None and rest:
                destination = rest.pop(0)
            if rest:
                _refuse_command(rest, spec)
            continue
        if word == "-" or not word.startswith("-"):
            if destination is not None:
                _refuse_command(words[index - 1 :], spec)
            destination = word
            continue
        pos = 1
        while pos < len(word):
            flag = word[pos]
            pos += 1
            if flag in _VALUE_FLAGS:
                value = word[pos:]
                if not value:
                    if index >= len(words):
                        raise ConfigError(f"SSH target {spec!r}: -{flag} needs a {_VALUE_FLAGS[flag]}")
                    value = words[index]
                    index += 1
                values[flag].append(value)
                break
            if flag == "F":
                raise ConfigError(f"SSH target {spec!r}: {_CONFIG_FILE_REFUSED}")
            if flag not in _PLAIN_FLAGS:
                hint = f" ({_REFUSED_HINTS[flag]} is not part of a target)" if flag in _REFUSED_HINTS else ""
                raise ConfigError(
                    f"SSH target {spec!r}: unsupported ssh option -{flag}{hint}; "
                    "supported: -p PORT, -i KEY, -l USER, -J JUMP, -o Key=Value, -4 -6 -C -q -T -v"
                )
    if destination is None:
        raise ConfigError(f"SSH target {spec!r}: no destination host (e.g. user@host)")
    target = _parse_destination(destination, spec)
    options = [_parse_option(value, spec) for value in values["o"]]
    return _merge(target, values, options, spec)


def _refuse_command(words: list[str], spec: str) -> None:
    raise ConfigError(
        f"SSH target {spec!r}: unexpected {' '.join(words)!r} after the destination; a target names a host, "
        "not a remote command"
    )


def _merge(target: SshTarget, values: dict[str, list[str]], options: list[tuple[str, str]], spec: str) -> SshTarget:
    """Combine flags and `-o` options; for single values the first one obtained wins, as in OpenSSH."""
    user = target.user or (values["l"][0] if values["l"] else None)
    port = target.port or (_parse_port(values["p"][0], spec) if values["p"] else None)
    jump = values["J"][0] if values["J"] else None
    identities = list(values["i"])
    host = target.host
    extra: dict[str, str] = {}
    for name, value in options:
        if name == "User":
            user = user or value
        elif name == "Port":
            port = port or _parse_port(value, spec)
        elif name == "ProxyJump":
            jump = jump or value
        elif name == "IdentityFile":
            identities.append(value)
        else:
            extra.setdefault(name, value)
    if jump is not None and jump.lower() == "none":
        jump = None
    return SshTarget(
        host=host,
        user=user,
        port=port,
        identity_files=tuple(identities),
        jump=jump,
        options=tuple(sorted(extra.items())),
    )


def _parse_option(text: str, spec: str) -> tuple[str, str]:
    """`Key=Value` or `Key Value` -> (canonical key, value); unknown keys and checking turned off are refused."""
    match = _OPTION_RE.match(text)
    key, value = (match.group(1), match.group(2).strip()) if match else (text.strip(), "")
    name = _OPTIONS.get(key.lower())
    if name is None:
        raise ConfigError(
            f"SSH target {spec!r}: unsupported ssh option -o {key}; supported: {', '.join(sorted(_OPTIONS.values()))}"
        )
    if not value:
        raise ConfigError(f"SSH target {spec!r}: -o {name} needs a value")
    if name in _INT_OPTIONS and not value.isdigit():
        raise ConfigError(f"SSH target {spec!r}: -o {name}={value}: expected a whole number of seconds or times")
    if name in _BOOL_OPTIONS:
        if value.lower() not in ("yes", "no"):
            raise ConfigError(f"SSH target {spec!r}: -o {name}={value}: expected yes or no")
        value = value.lower()
    if name == "StrictHostKeyChecking":
        strict = _STRICT_VALUES.get(value.lower())
        if strict is None:
            raise ConfigError(
                f"SSH target {spec!r}: -o StrictHostKeyChecking={value} would turn host-key checking off, "
                "which is not allowed; use `accept_new_host_key` to record a new host's key on first use"
            )
        value = strict
    if name == "UserKnownHostsFile" and value.split()[0].lower() in ("none", "/dev/null"):
        raise ConfigError(
            f"SSH target {spec!r}: -o UserKnownHostsFile={value} would turn host-key checking off, "
            "which is not allowed; give a real file (it is created on first use with `accept_new_host_key`)"
        )
    return name, value


def _parse_destination(text: str, spec: str) -> SshTarget:
    """`ssh://[user@]host[:port]`, `[user@]host[:port]`, `[user@][v6addr]:port` or `user@v6addr`."""
    dest = text
    if dest.lower().startswith("ssh://"):
        dest = dest[len("ssh://") :].rstrip("/")
        if "/" in dest:
            raise ConfigError(f"SSH target {spec!r}: an ssh:// address takes no path")
    user: str | None = None
    if "@" in dest:
        user, dest = dest.rsplit("@", 1)
        if not user:
            raise ConfigError(f"SSH target {spec!r}: empty user name before '@'")
    port: int | None = None
    if dest.startswith("["):
        close = dest.find("]")
        if close < 0:
            raise ConfigError(f"SSH target {spec!r}: '[' without a closing ']'")
        host, rest = dest[1:close], dest[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"SSH target {spec!r}: unexpected {rest!r} after ']'")
            port = _parse_port(rest[1:], spec)
    elif dest.count(":") == 1:
        host, port_text = dest.split(":")
        port = _parse_port(port_text, spec)
    else:
        host = dest  # a name, an IPv4 address, or a bare IPv6 address (several ':')
    if not host or any(ch.isspace() for ch in host) or host.startswith("-"):
        raise ConfigError(f"SSH target {spec!r}: {host!r} is not a host name, address or ssh config alias")
    return SshTarget(host=host, user=user, port=port)


def _parse_port(text: str, spec: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"SSH target {spec!r}: port {text!r} is not a number from 1 to 65535")
    return int(text)
