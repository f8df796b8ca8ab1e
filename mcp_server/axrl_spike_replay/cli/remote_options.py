"""The options every verb that can run on a GPU node shares (`replay`, `sweep`, `node`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from axrl_spike_replay.vocabulary import Backend

if TYPE_CHECKING:
    from axrl_spike_replay.investigation.request import Where
    from axrl_spike_replay.remote.options import RemoteOptions


def add_connection_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--remote-python, --known-hosts, --accept-new-host-key."""
    parser.add_argument(
        "--remote-python",
        metavar="PATH",
        default=None,
        help="the node's Python interpreter (default: the target's python in spike-replay.yaml, else python3)",
    )
    parser.add_argument(
        "--known-hosts",
        metavar="FILE",
        default=None,
        help="known_hosts file to verify the node's host key against (default: UserKnownHostsFile of the ssh "
        "config, else ~/.ssh/known_hosts)",
    )
    parser.add_argument(
        "--accept-new-host-key",
        action="store_true",
        help="record the host key of a node not yet in known_hosts (like OpenSSH's accept-new); a changed key "
        "is always refused",
    )


def add_remote_options(parser: argparse.ArgumentParser) -> None:
    """--target, --backend, --patch, --timeout and the connection options."""
    group = parser.add_argument_group("where and how to run (GPU node over SSH, external command)")
    group.add_argument(
        "--target",
        default="local",
        help="'local' (default), a target name from spike-replay.yaml, or an ssh target as you would type it: "
        "'ssh -p 2222 root@10.0.0.5', user@host:port, ssh://user@host:port or a ~/.ssh/config Host",
    )
    group.add_argument(
        "--backend",
        choices=Backend.values(),
        default="torch",
        help="torch: the built-in engine; command: the external replay command of spike-replay.yaml",
    )
    group.add_argument(
        "--patch",
        metavar="FILE.diff",
        action="append",
        default=None,
        help="apply this unified diff in a temporary git worktree of the training checkout (--backend command); "
        "repeat to apply several, in order",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="kill the run (its whole process group) after this many seconds; partial logs are kept",
    )
    add_connection_options(group)


def remote_options_from_args(args: argparse.Namespace) -> RemoteOptions:
    """The RemoteOptions of parsed arguments."""
    from axrl_spike_replay.remote.options import RemoteOptions

    return RemoteOptions(
        remote_python=getattr(args, "remote_python", None),
        known_hosts=getattr(args, "known_hosts", None),
        accept_new_host_key=bool(getattr(args, "accept_new_host_key", False)),
        timeout_s=getattr(args, "timeout", None),
        patches=tuple(getattr(args, "patch", None) or ()),
    )


def where_from_args(args: argparse.Namespace) -> Where:
    """Where a `replay`, `sweep` or `attribute` of parsed arguments runs (the request's `Where` part)."""
    from axrl_spike_replay.investigation.request import LOCAL, Where

    return Where(
        target=getattr(args, "target", None) or LOCAL,
        backend=Backend(getattr(args, "backend", Backend.TORCH)),
        patches=tuple(getattr(args, "patch", None) or ()),
        remote_python=getattr(args, "remote_python", None),
        known_hosts=getattr(args, "known_hosts", None),
        accept_new_host_key=bool(getattr(args, "accept_new_host_key", False)),
        timeout_s=getattr(args, "timeout", None),
    )
