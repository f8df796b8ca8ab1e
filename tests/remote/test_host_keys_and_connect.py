"""Trusting the right host, and failing fast with a clear message when a node cannot be reached or refuses us."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from ssh_loopback import Keys, LoopbackServer, free_port

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.transport.connect import ConnectSettings
from axrl_spike_replay.remote.transport.host_keys import HostKeyPolicy, record_host_key
from axrl_spike_replay.remote.transport.remote_errors import HostKeyError, RemoteError
from axrl_spike_replay.remote.transport.session import open_session
from axrl_spike_replay.remote.transport.ssh_library import asyncssh


def connect_and_run(spec: str, settings: ConnectSettings | None = None) -> tuple[str, int]:
    """Open a session, run `echo ok`, return (stdout, number of jump hops)."""

    async def story() -> tuple[str, int]:
        async with await open_session(spec, settings) as session:
            got = await session.capture("echo ok")
            return got.stdout.strip(), len(session.connection.hops)

    return asyncio.run(story())


def fingerprint_of(public_key: str) -> str:
    return asyncssh.import_public_key(public_key).get_fingerprint("sha256")


def test_a_known_host_connects(server: LoopbackServer) -> None:
    assert connect_and_run(server.spec()) == ("ok", 0)


def test_an_unknown_host_is_refused_with_its_fingerprint(server: LoopbackServer, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    with pytest.raises(HostKeyError) as info:
        connect_and_run(server.spec(known_hosts=empty))
    message = str(info.value)
    assert f"[127.0.0.1]:{server.port} is not in known_hosts ({empty})" in message
    assert fingerprint_of(server.keys.host_pub) in message and "`accept_new_host_key`" in message
    assert not empty.exists()


def test_accept_new_records_the_key_once_then_plain_checking_trusts_it(server: LoopbackServer, tmp_path: Path) -> None:
    known = tmp_path / "fresh" / "known_hosts"
    spec = server.spec(known_hosts=known)
    assert connect_and_run(spec, ConnectSettings(host_keys=HostKeyPolicy(accept_new=True))) == ("ok", 0)
    assert known.read_text() == f"[127.0.0.1]:{server.port} {server.keys.host_pub}\n"
    assert connect_and_run(spec) == ("ok", 0)  # now known: no opt-in needed
    assert connect_and_run(spec + " -o StrictHostKeyChecking=accept-new") == ("ok", 0)
    assert len(known.read_text().splitlines()) == 1


def test_a_changed_host_key_is_refused_even_with_accept_new(server: LoopbackServer, tmp_path: Path) -> None:
    impostor = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{server.port} {impostor}\n")
    before = known.read_text()
    for settings in (None, ConnectSettings(host_keys=HostKeyPolicy(accept_new=True))):
        with pytest.raises(HostKeyError) as info:
            connect_and_run(server.spec(known_hosts=known), settings)
        message = str(info.value)
        assert message.count("HOST KEY CHANGED") == 1
        assert fingerprint_of(server.keys.host_pub) in message  # what the node presented
        assert fingerprint_of(impostor) in message  # what was recorded
    assert known.read_text() == before


@contextmanager
def users_ssh_config(text: str) -> Iterator[None]:
    """`text` as the user's ~/.ssh/config (the tests' own home) for the block."""
    config = Path.home() / ".ssh" / "config"
    config.parent.mkdir(exist_ok=True)
    config.write_text(text)
    try:
        yield
    finally:
        config.unlink()


def test_known_hosts_flag_overrides_the_ssh_config(server: LoopbackServer, tmp_path: Path) -> None:
    alias = f"gpu-node-{server.kind}"
    with users_ssh_config(
        f"Host {alias}\n  HostName 127.0.0.1\n  Port {server.port}\n  User {server.user}\n"
        f"  IdentityFile {server.keys.client_key}\n  UserKnownHostsFile {server.known_hosts}\n"
    ):
        assert connect_and_run(alias) == ("ok", 0)
        other = tmp_path / "other_known_hosts"
        with pytest.raises(HostKeyError, match=f"not in known_hosts \\({other}\\)"):
            connect_and_run(alias, ConnectSettings(host_keys=HostKeyPolicy(known_hosts=str(other))))


def test_a_host_alias_from_the_users_ssh_config(server: LoopbackServer) -> None:
    ssh_dir = Path.home() / ".ssh"
    ssh_dir.mkdir(exist_ok=True)
    config = ssh_dir / "config"
    config.write_text(
        f"Host gpu-alias-{server.kind}\n  HostName 127.0.0.1\n  Port {server.port}\n  User {server.user}\n"
        f"  IdentityFile {server.keys.client_key}\n  UserKnownHostsFile {server.known_hosts}\n"
    )
    try:
        assert connect_and_run(f"gpu-alias-{server.kind}") == ("ok", 0)
    finally:
        config.unlink()


def test_a_jump_host_from_the_command_line_or_the_config(openssh_server: LoopbackServer, tmp_path: Path) -> None:
    server = openssh_server
    common = (
        f"  HostName 127.0.0.1\n  Port {server.port}\n  User {server.user}\n"
        f"  IdentityFile {server.keys.client_key}\n  UserKnownHostsFile {server.known_hosts}\n"
    )
    with users_ssh_config(f"Host bastion\n{common}Host inner\n{common}  ProxyJump bastion\nHost direct\n{common}"):
        assert connect_and_run("inner") == ("ok", 1)
        assert connect_and_run("ssh -J bastion direct") == ("ok", 1)


def test_a_wrong_key_fails_with_a_clear_message(server: LoopbackServer, tmp_path: Path) -> None:
    stranger = Keys.make(tmp_path / "stranger")
    with pytest.raises(RemoteError) as info:
        connect_and_run(server.spec(key=stranger.client_key))
    assert "permission denied" in str(info.value) and "-i KEY" in str(info.value)


def test_an_unreachable_port_fails_with_a_clear_message(keys: Keys, tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(RemoteError) as info:
        connect_and_run(f"ssh -p {port} -i {keys.client_key} root@127.0.0.1")
    assert "connection refused" in str(info.value) and f"-p {port}" in str(info.value)


def test_a_config_file_is_refused_before_anything_in_it_runs(tmp_path: Path) -> None:
    ran = [tmp_path / "match-exec-ran", tmp_path / "proxy-command-ran"]
    config = tmp_path / "ssh_config"
    config.write_text(f'Match exec "touch {ran[0]}"\nHost *\n  ProxyCommand touch {ran[1]}\n')
    with pytest.raises(ConfigError, match=r"-F \(an ssh config file\) is refused"):
        connect_and_run(f"ssh -F {config} node")
    assert not any(path.exists() for path in ran)


def test_recording_keeps_existing_lines_and_the_file_mode(tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("old.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl")
    os.chmod(known, 0o600)
    key = asyncssh.generate_private_key("ssh-ed25519")
    record_host_key(known, "node", 2222, key)
    record_host_key(known, "node22", 22, key)
    lines = known.read_text().splitlines()
    assert lines[0].startswith("old.example ")
    assert lines[1].startswith("[node]:2222 ssh-ed25519 ") and lines[2].startswith("node22 ssh-ed25519 ")
    assert stat.S_IMODE(known.stat().st_mode) == 0o600
    with pytest.raises(HostKeyError, match="not a regular file"):
        record_host_key(tmp_path, "node", 22, key)
