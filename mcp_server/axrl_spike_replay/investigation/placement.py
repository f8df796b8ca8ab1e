"""Where a request's processes run and what launching them there would run: the placement of a replay launched
on several SSH nodes or in a Slurm allocation (`placement_for`), and the launcher's dry run for any request
(`launch_dry_run`: rank processes here, torchrun agents or an `sbatch`), which `plan` and `--dry-run` print.
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import LOCAL, ReplayRequest, launched
from axrl_spike_replay.remote.launchers.launch_config import LOCAL_LOGIN, multinode_nodes, slurm_login
from axrl_spike_replay.remote.launchers.launch_job import LaunchNode
from axrl_spike_replay.remote.launchers.launcher import DryRun
from axrl_spike_replay.remote.launchers.replay_launch import Placement
from axrl_spike_replay.remote.launchers.slurm_command import SlurmSettings
from axrl_spike_replay.remote.launchers.spawn_launch import spawn_dry_run
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.workspace_config import WorkspaceConfig, load_workspace_config, resolve_target
from axrl_spike_replay.vocabulary import Backend, Device


def launch_dry_run(
    request: ReplayRequest, world_size: int, nproc: int, shard: bool, options: RemoteOptions | None = None
) -> DryRun | None:
    """What the launcher of `request` would run for `nproc` processes (`shard`: FSDP2 over them), `world_size` the
    snapshot's saved one; nothing connects or starts. None where no launcher of ours starts the processes: the
    torch engine on one SSH node (this package's own `replay` there) and the `command` backend."""
    if launched(request):
        config = load_workspace_config(Path(request.workspace or "."))
        return placement_for(request, config, world_size).dry_run(options)
    if request.where.backend == Backend.COMMAND or request.where.target != LOCAL:
        return None
    return spawn_dry_run(nproc, str(request.how.device), shard)


def request_dry_run(request: ReplayRequest) -> DryRun | None:
    """`launch_dry_run` of a request as it stands (`--dry-run`): its processes and sharding as the plan chooses them
    from the snapshot's metadata (no weight read, no node probed); None where no launcher of ours starts them."""
    from axrl_spike_replay.replay.plans.replay_plan import plan_replay

    how = request.how
    plan = plan_replay(request.what.snapshot, nproc=how.nproc, device=str(how.device), shard=str(how.shard))
    nproc = plan.chosen.nproc if plan.chosen is not None else (how.nproc or plan.world_size)
    shard = plan.chosen.sharded if plan.chosen is not None else False
    options = RemoteOptions(
        remote_python=request.where.remote_python,
        known_hosts=request.where.known_hosts,
        accept_new_host_key=request.where.accept_new_host_key,
    )
    return launch_dry_run(request, plan.world_size, nproc, shard, options)


def placement_for(request: ReplayRequest, config: WorkspaceConfig, world_size: int) -> Placement:
    """Where the request's processes run, with `nproc` (default: the saved world size) spread over the nodes."""
    where, nproc = request.where, request.how.nproc
    launch = config.launch
    if where.slurm is not None or (launch is not None and where.target in launch.slurm):
        return _slurm_placement(request, config, world_size)
    if where.targets:
        nodes = tuple(_ad_hoc_node(text, config, where.remote_python) for text in where.targets)
        name = "+".join(node.name for node in nodes)
        default_per_node = None
        port, rendezvous_timeout = None, None
    else:
        if launch is None or where.target not in launch.multinode:
            raise ConfigError(f"`target` {where.target!r} names no multinode: or slurm: entry", "target")
        entry = launch.multinode[where.target]
        nodes = multinode_nodes(entry, config)
        if where.remote_python:
            nodes = tuple(replace(node, python=where.remote_python) for node in nodes)
        name, default_per_node = entry.name, entry.nproc_per_node
        port, rendezvous_timeout = entry.rendezvous_port, entry.rendezvous_timeout_s
    per_node = _per_node(nproc, len(nodes), default_per_node, world_size, name)
    knobs: dict[str, Any] = {"rendezvous_port": port}
    if rendezvous_timeout is not None:
        knobs["rendezvous_timeout_s"] = rendezvous_timeout
    return Placement(name, nodes=nodes, nproc_per_node=per_node, **knobs)


def _per_node(nproc: int | None, nodes: int, capacity: int | None, world_size: int, name: str) -> int:
    """Processes on each node: `nproc` spread evenly; else one per saved rank (full fidelity) up to what the
    placement holds (`capacity` per node, when it says), spread evenly."""
    full = min(world_size, nodes * capacity) if capacity else world_size
    total = nproc if nproc is not None else full
    if total % nodes:
        fits = [n for n in range(nodes, world_size + 1, nodes)]
        hint = f"; e.g. `nproc` {fits[-1]}" if fits else f"; use at most {world_size} node(s)"
        raise ConfigError(
            f"`nproc` {total} does not spread evenly over the {nodes} node(s) of {name} (torchrun starts the same "
            f"number of processes on each){hint}",
            "nproc",
        )
    return total // nodes


def _ad_hoc_node(text: str, config: WorkspaceConfig, remote_python: str | None) -> LaunchNode:
    """A node given as a target: the other nodes reach it at its SSH address when that is an IP address (else at
    its host name, as torchrun resolves it); a configured target's name is its node name."""
    target = resolve_target(text, config, remote_python)
    address: str | None = None
    try:
        address = str(ipaddress.ip_address(target.ssh.host))
    except ValueError:
        address = None
    return LaunchNode(target.label, target, address=address)


def _slurm_placement(request: ReplayRequest, config: WorkspaceConfig, world_size: int) -> Placement:
    """The login node and the allocation: the slurm: entry `target` names, with the request's settings over it;
    else `target` as the login node ("local": this machine) with the request's settings alone."""
    where = request.where
    given = dict(where.slurm or {})
    launch = config.launch
    if launch is not None and where.target in launch.slurm:
        entry = launch.slurm[where.target]
        login = slurm_login(entry, config)
        settings = replace(entry.settings, **given)
        name = entry.name
    else:
        if where.target == LOCAL or where.target == LOCAL_LOGIN:
            login = LaunchNode(LOCAL_LOGIN, python=where.remote_python or sys.executable)
        else:
            target = resolve_target(where.target, config, where.remote_python)
            login = LaunchNode(target.label, target)
        settings = SlurmSettings(**given)
        name = f"slurm@{login.name}"
    if where.remote_python:
        login = replace(login, python=where.remote_python)
    capacity = settings.nproc_per_node or settings.gpus_per_node
    per_node = _per_node(request.how.nproc, settings.nodes, capacity, world_size, name)
    settings = replace(settings, nproc_per_node=per_node)
    if request.how.device == Device.CUDA and settings.gpus_per_node is None:
        settings = replace(settings, gpus_per_node=settings.processes_per_node)
    if request.how.device == Device.CUDA and (settings.gpus_per_node or 0) < settings.processes_per_node:
        raise ConfigError(
            f"`slurm`: {settings.processes_per_node} CUDA process(es) per node need as many GPUs per node, but "
            f"gpus_per_node is {settings.gpus_per_node}",
            "slurm",
        )
    return Placement(name, login=login, slurm=settings)
