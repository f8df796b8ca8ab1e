"""The options every verb that can run on a GPU node shares (`replay`, `sweep`, `node`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from axrl_spike_replay.cli.request_options import add_declared_option, add_request_options
from axrl_spike_replay.investigation.request import Where
from axrl_spike_replay.vocabulary import Backend, Verb

if TYPE_CHECKING:
    from axrl_spike_replay.remote.transport.options import RemoteOptions


def add_connection_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--remote-python, --known-hosts, --accept-new-host-key (as the request declares them)."""
    for name in ("remote_python", "known_hosts", "accept_new_host_key"):
        add_declared_option(parser, name)


def add_remote_options(parser: argparse.ArgumentParser, verb: Verb) -> None:
    """--target, --patch and the Slurm options (mapped here), and the options the request declares for `verb`'s
    `Where`: --backend, --timeout and the connection options."""
    group = parser.add_argument_group("where and how to run (GPU node over SSH, external command)")
    group.add_argument(
        "--target",
        action="append",
        default=None,
        help="'local' (default), a target name from spike-replay.yaml (a node, a multinode: group or a slurm: "
        "cluster), or an ssh target as you would type it: 'ssh -p 2222 root@10.0.0.5', user@host:port, "
        "ssh://user@host:port or a ~/.ssh/config Host; repeat it to run on several nodes (one torchrun agent on each, "
        "one rendezvous)",
    )
    group.add_argument(
        "--patch",
        metavar="FILE.diff",
        action="append",
        default=None,
        help="apply this unified diff in a temporary git worktree of the training checkout (--backend command); "
        "repeat to apply several, in order",
    )
    add_request_options(group, verb, Where)
    add_slurm_options(parser)


SLURM_OPTIONS = ("partition", "account", "time", "nodes", "gpus_per_node", "nproc_per_node", "cpus_per_task")


def add_slurm_options(parser: argparse.ArgumentParser) -> None:
    """--slurm and the allocation's settings (over those of the `slurm:` entry --target names)."""
    group = parser.add_argument_group("Slurm (sbatch from the --target login node, or this machine: srun → torchrun)")
    group.add_argument(
        "--slurm",
        action="store_true",
        help="run the replay as a Slurm job submitted from --target (a login node; 'local': this machine), with the "
        "settings below; a --target naming a slurm: entry of spike-replay.yaml needs no --slurm",
    )
    group.add_argument("--partition", default=None, help="sbatch --partition (default: the cluster's default)")
    group.add_argument("--account", default=None, help="sbatch --account")
    group.add_argument("--time", default=None, metavar="HH:MM:SS", help="sbatch --time")
    group.add_argument("--nodes", type=int, default=None, help="nodes to allocate (default 1)")
    group.add_argument("--gpus-per-node", type=int, default=None, metavar="N", help="sbatch --gpus-per-node")
    group.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="replay processes per node (default: GPUs per node)",
    )
    group.add_argument("--cpus-per-task", type=int, default=None, metavar="N", help="CPUs for each node's processes")


def slurm_from_args(args: argparse.Namespace) -> dict[str, object] | None:
    """The Slurm settings given as arguments (None: no Slurm option given)."""
    given = {name: getattr(args, name, None) for name in SLURM_OPTIONS}
    given = {name: value for name, value in given.items() if value is not None}
    if not given and not getattr(args, "slurm", False):
        return None
    return given


def remote_options_from_args(args: argparse.Namespace) -> RemoteOptions:
    """The RemoteOptions of parsed arguments."""
    from axrl_spike_replay.remote.transport.options import RemoteOptions

    return RemoteOptions(
        remote_python=getattr(args, "remote_python", None),
        known_hosts=getattr(args, "known_hosts", None),
        accept_new_host_key=bool(getattr(args, "accept_new_host_key", False)),
        timeout_s=getattr(args, "timeout_s", None),
        patches=tuple(getattr(args, "patch", None) or ()),
    )


def where_from_args(args: argparse.Namespace) -> Where:
    """Where a `replay`, `sweep` or `attribute` of parsed arguments runs (the request's `Where` part)."""
    from axrl_spike_replay.investigation.request import LOCAL

    targets = list(getattr(args, "target", None) or [])
    return Where(
        target=targets[0] if len(targets) == 1 else LOCAL,
        targets=tuple(targets) if len(targets) > 1 else (),
        slurm=slurm_from_args(args),
        backend=Backend(getattr(args, "backend", Backend.TORCH)),
        patches=tuple(getattr(args, "patch", None) or ()),
        remote_python=getattr(args, "remote_python", None),
        known_hosts=getattr(args, "known_hosts", None),
        accept_new_host_key=bool(getattr(args, "accept_new_host_key", False)),
        timeout_s=getattr(args, "timeout_s", None),
    )
