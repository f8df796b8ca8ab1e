"""A user names a GPU node the way they would type it; the parser understands it or says which part it refuses."""

from __future__ import annotations

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.transport.target import SshTarget, parse_target

TABLE = [
    # (as typed, host, user, port, identity files, jump, options)
    ("ssh -p 26461 root@10.100.4.23", "10.100.4.23", "root", 26461, (), None, ()),
    ("ssh root@10.100.4.23 -p 26461", "10.100.4.23", "root", 26461, (), None, ()),
    ("ssh -p26461 -i ~/.ssh/gpu_key root@gpu-a", "gpu-a", "root", 26461, ("~/.ssh/gpu_key",), None, ()),
    ("ssh -l alice -J bastion:2200 node7", "node7", "alice", None, (), "bastion:2200", ()),
    ("ssh -qCp 2222 node7", "node7", None, 2222, (), None, ()),
    (
        "ssh -o ServerAliveInterval=5 -o 'UserKnownHostsFile /tmp/kh' bob@node",
        "node",
        "bob",
        None,
        (),
        None,
        (("ServerAliveInterval", "5"), ("UserKnownHostsFile", "/tmp/kh")),
    ),
    ("ssh -o Port=2022 -o User=carol -o ProxyJump=jump node", "node", "carol", 2022, (), "jump", ()),
    (
        "ssh -o stricthostkeychecking=accept-new node",
        "node",
        None,
        None,
        (),
        None,
        (("StrictHostKeyChecking", "accept-new"),),
    ),
    ("root@10.100.4.23:26461", "10.100.4.23", "root", 26461, (), None, ()),
    ("10.100.4.23:26461", "10.100.4.23", None, 26461, (), None, ()),
    ("ssh://root@10.100.4.23:26461", "10.100.4.23", "root", 26461, (), None, ()),
    ("ssh://gpu-a", "gpu-a", None, None, (), None, ()),
    ("gpu-a", "gpu-a", None, None, (), None, ()),  # a Host alias from ~/.ssh/config
    ("root@[fe80::1]:2222", "fe80::1", "root", 2222, (), None, ()),
    ("ssh root@::1", "::1", "root", None, (), None, ()),
    ("  ssh   -p 22 -- root@host  ", "host", "root", 22, (), None, ()),
]


@pytest.mark.parametrize(("spec", "host", "user", "port", "identities", "jump", "options"), TABLE)
def test_targets_typed_the_usual_ways_are_understood(spec, host, user, port, identities, jump, options) -> None:
    target = parse_target(spec)
    assert (target.host, target.user, target.port) == (host, user, port)
    assert target.identity_files == identities
    assert target.jump == jump
    assert target.options == options
    assert target.spec == spec.strip()


def test_first_value_wins_like_openssh() -> None:
    target = parse_target("ssh -p 1111 -o Port=2222 -l first -o User=second node")
    assert (target.port, target.user) == (1111, "first")


def test_several_keys() -> None:
    target = parse_target("ssh -i a.key -i b.key -o IdentityFile=c.key node")
    assert target.identity_files == ("a.key", "b.key", "c.key")


@pytest.mark.parametrize(
    "spec",
    ["ssh -F ./ssh_config node", "ssh -Fcfg node", "ssh -vF cfg node", "-F cfg node", "ssh -J 'x -F cfg' node"],
)
def test_a_config_file_is_refused_for_what_it_could_run(spec: str) -> None:
    """An ssh config file can hold ProxyCommand, LocalCommand and `Match exec`: a target names none of them."""
    with pytest.raises(ConfigError) as info:
        target = parse_target(spec)
        if target.jump:  # a jump host's spec is parsed when the connection is opened
            parse_target(target.jump)
    assert "-F (an ssh config file) is refused" in str(info.value) and "~/.ssh/config" in str(info.value)


def test_label_shows_user_host_and_port() -> None:
    assert parse_target("root@[fe80::1]:2222").label == "root@[fe80::1]:2222"
    assert SshTarget(host="node").label == "node"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("ssh -L 8080:localhost:80 node", "-L (port forwarding"),
        ("ssh -t node", "-t (a terminal"),
        ("ssh -Z node", "unsupported ssh option -Z"),
        ("ssh -o ForwardX11=yes node", "unsupported ssh option -o ForwardX11"),
        ("ssh -o StrictHostKeyChecking=no node", "would turn host-key checking off"),
        ("ssh -o UserKnownHostsFile=/dev/null node", "would turn host-key checking off"),
        ("ssh node nvidia-smi", "not a remote command"),
        ("ssh -p", "-p needs a port"),
        ("ssh -p 99999 node", "port '99999'"),
        ("node:http", "port 'http'"),
        ("ssh -v", "no destination host"),
        ("", "SSH target is empty"),
        ("ssh 'unclosed", "cannot split"),
        ("ssh://node/path", "takes no path"),
        ("@node", "empty user name"),
        ("ssh -o ServerAliveInterval=soon node", "whole number"),
    ],
)
def test_bad_targets_are_refused_by_name(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        parse_target(spec)
    assert says in str(info.value)
