"""`plan`: what a replay of a snapshot needs, against where it would run: this machine, an SSH node (its GPUs
from the node probe), a `multinode:` group (its first node probed, the others taken to be alike), or a node
described by its GPUs. The faces call `plan_for`; a replay here is refused by `refuse_what_cannot_fit`, a CUDA
replay launched on several nodes by `refuse_on_nodes` (a Slurm allocation's GPUs are known only once it runs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.investigation.node_description import check_described_node
from axrl_spike_replay.investigation.placement import launch_dry_run
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.transport.target_config import ResolvedTarget
from axrl_spike_replay.replay.plans.replay_plan import (
    GPU_USABLE,
    HERE,
    Capacity,
    PlanRefused,
    ReplayPlan,
    check_fits,
    node_capacity,
    plan_replay,
)
from axrl_spike_replay.replay.plans.speed_inputs import speed_inputs
from axrl_spike_replay.replay.streamed.speeds import Speeds
from axrl_spike_replay.vocabulary import Device
from axrl_spike_replay.workspace.paths import TMP_DIR

if TYPE_CHECKING:
    from axrl_spike_replay.remote.nodes.remote_speeds import SpeedsRequest

LOCAL = "local"
NODE_SPEEDS = "node-speeds.json"  # this machine's read and compute speeds (`replay.plans.node_speeds`)
NODE_SPEEDS_REMOTE = "node-speeds-remote.json"  # SSH nodes' speeds, per host (`remote.nodes.remote_speeds`)


def plan_for(
    snapshot: str | Path,
    *,
    target: str | None = None,
    nproc: int | None = None,
    device: str = "cpu",
    shard: str = "auto",
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
    workspace: str | Path = ".",
    options: RemoteOptions | None = None,
    progress: Callable[[str], None] | None = None,
) -> ReplayPlan:
    """The replay plan of `snapshot` where `target` says (see the module docstring); no weight is read. For a
    `slurm:` entry with `gpus_per_node`, `gpu_memory_gib` alone describes its nodes. Planned here, the streamed
    row's time is at this machine's measured speeds (kept in the workspace's `tmp/spike-replay/node-speeds.json`,
    so later plans reuse them); planned for an SSH node (or a `multinode:` entry's first), at that node's, measured
    there over the probe's connection (kept per node in `node-speeds-remote.json` beside it); for a node described
    or a Slurm entry, at assumed ones, said."""
    if gpus is None and gpu_memory_gib is not None and target not in (None, LOCAL):
        gpus = _slurm_gpus(str(target), workspace)
    if (gpus is None) != (gpu_memory_gib is None):
        raise ConfigError("give `gpus` and `gpu_memory_gib` together (a node described by its GPUs)", "gpus")
    capacity: Capacity | str | None = HERE
    nodes = 1
    notes: list[str] = []
    speeds: Speeds | None = None
    if gpus is not None and gpu_memory_gib is not None:
        check_described_node(gpus, gpu_memory_gib)
        device = "cuda"
        capacity = Capacity(
            "the node described", "cuda", gpus, int(gpu_memory_gib * (1 << 30) * GPU_USABLE), "arguments"
        )
    if target not in (None, LOCAL):
        assert target is not None
        measured = None if gpus is not None else snapshot  # a node described is not probed: nothing measured
        found, nodes, notes, speeds = _target_capacity(target, device, workspace, options, progress, measured)
        if gpus is None:
            capacity = found
    here = capacity == HERE  # the streamed row's time at this machine's measured speeds, kept in the workspace
    cache = _cache(workspace, NODE_SPEEDS) if here else None
    plan = plan_replay(snapshot, nproc=nproc, device=device, capacity=capacity, shard=shard, nodes=nodes,
                       measure_speeds=here, speeds_cache=cache, speeds=speeds)  # fmt: skip
    plan.notes += notes
    if plan.chosen is not None:
        where, how = Where(target=target or LOCAL), How(nproc=nproc, device=Device(device))
        request = replay_request(What(Path(snapshot)), where, how, workspace=workspace)
        dry = launch_dry_run(request, plan.world_size, plan.chosen.nproc, plan.chosen.sharded, options)
        plan.launch = dry.to_json() if dry is not None else None
    return plan


def _cache(workspace: str | Path, name: str) -> Path | None:
    """The workspace's speeds cache `name` (None: no workspace directory to keep it in)."""
    return Path(workspace) / TMP_DIR / name if Path(workspace).is_dir() else None


def _speeds_request(
    snapshot: str | Path, device: str, workspace: str | Path, options: RemoteOptions | None
) -> SpeedsRequest:
    """What a probed node's speeds are measured for: the weights the replay reads, in its dtype, on `device`."""
    from axrl_spike_replay.remote.nodes.remote_speeds import MEASURE_TIMEOUT_S, SpeedsRequest

    weights, dtype = speed_inputs(snapshot)
    timeout = options.timeout_s if options is not None and options.timeout_s is not None else MEASURE_TIMEOUT_S
    return SpeedsRequest(str(weights), device, dtype, _cache(workspace, NODE_SPEEDS_REMOTE), timeout)


def _slurm_gpus(target: str, workspace: str | Path) -> int | None:
    """`gpus_per_node` of the `slurm:` entry `target` names (None: no such entry, or it does not say)."""
    from axrl_spike_replay.remote.workspace_config import load_workspace_config

    launch = load_workspace_config(Path(workspace)).launch
    return launch.slurm[target].settings.gpus_per_node if launch is not None and target in launch.slurm else None


def _target_capacity(
    target: str,
    device: str,
    workspace: str | Path,
    options: RemoteOptions | None,
    progress: Callable[[str], None] | None,
    snapshot: str | Path | None = None,
) -> tuple[Capacity | None, int, list[str], Speeds | None]:
    """(capacity of one node, nodes, notes, its speeds) of a target: an SSH node or a `multinode:` or `slurm:`
    entry, its (first) node probed and its speeds for a replay of `snapshot` measured there. Without `snapshot` (its
    GPUs described), only how many nodes it has (nothing probed)."""
    from axrl_spike_replay.remote.node import probe_node
    from axrl_spike_replay.remote.workspace_config import load_workspace_config, resolve_target

    options = options or RemoteOptions()
    described = snapshot is None
    config = load_workspace_config(Path(workspace))
    launch = config.launch
    if launch is not None and target in launch.slurm:
        settings = launch.slurm[target].settings
        if described:
            note = f"Slurm entry {target!r}: {settings.nodes} node(s) of the GPUs described"
            return None, settings.nodes, [note], None
        note = (
            f"Slurm entry {target!r}: {settings.nodes} node(s); the GPUs' memory is known only once the job runs: "
            "give `gpu_memory_gib` (and `gpus` unless the entry says gpus_per_node) to plan against them"
        )
        return None, settings.nodes, [note], None
    nodes, first = 1, target
    notes: list[str] = []
    if described and (launch is None or target not in launch.multinode):
        return None, 1, [], None
    if launch is not None and target in launch.multinode:
        entry = launch.multinode[target]
        nodes, first = len(entry.nodes), entry.nodes[0]
        if described:
            return None, nodes, [f"multinode entry {target!r}: {nodes} node(s) of the GPUs described"], None
        notes.append(f"multinode entry {target!r}: {first} probed; its other {nodes - 1} node(s) taken to be alike")
    resolve_target(first, config, options.remote_python)  # a target refused before the snapshot is read
    speeds = None if snapshot is None else _speeds_request(snapshot, device, workspace, options)
    report = probe_node(
        first, options.remote_python, options=options, workspace=workspace, progress=progress, speeds=speeds
    )
    capacity = node_capacity(report, device)
    if capacity is None:
        notes.append(f"{first}: a CPU replay's memory there is not probed; capacity unknown")
    return capacity, nodes, notes, report.speeds


def refuse_what_cannot_fit(
    snapshot: str | Path, nproc: int | None, device: str, configs: int = 1, shard: str = "off"
) -> None:
    """PlanRefused, with the plan, when a replay of this engine on `nproc` processes here cannot fit this machine
    (`shard`: off, the whole model in each process; on, FSDP2; auto, sharded when the whole model does not fit).
    A snapshot the plan cannot read passes: the engine names what is wrong with it."""
    try:
        plan = plan_replay(snapshot, nproc=nproc, device=device, shard=shard, configs=configs)
    except PlanRefused:
        raise
    except Exception:  # a snapshot the plan cannot read is the engine's to name, by its own rules
        return
    if plan.capacity is not None and plan.capacity.devices == 0:
        return  # CUDA asked where there is none: the engine says so
    check_fits(plan)


def refuse_on_nodes(
    snapshot: str | Path,
    first: ResolvedTarget,
    *,
    nproc: int,
    nodes: int,
    configs: int = 1,
    options: RemoteOptions | None = None,
    progress: Callable[[str], None] | None = None,
    shard: str = "off",
) -> Capacity:
    """Before a CUDA replay is launched on `nodes` nodes like `first`: probe `first` (one SSH round trip) and refuse
    by name a node without GPUs, or, with the plan, a layout that does not fit them (`shard` as the replay asks).
    The probed node's capacity, for the engine's `shard: auto`."""
    from axrl_spike_replay.remote.node import probe_node

    options = options or RemoteOptions()
    report = probe_node(first, options.remote_python, options=options, progress=progress)
    capacity = node_capacity(report, "cuda")
    if capacity is None or capacity.devices == 0:
        raise ConfigError(
            f"`device` cuda: node {report.target!r} has no GPU (nvidia-smi: {report.nvidia_smi}); replay on CPU "
            "(`device` cpu) or on nodes with GPUs",
            "device",
        )
    try:
        plan = plan_replay(snapshot, nproc=nproc, device="cuda", capacity=capacity, shard=shard, configs=configs,
                           nodes=nodes)  # fmt: skip
    except PlanRefused:
        raise
    except AxrlError:
        return capacity  # the engine names what is wrong with the snapshot
    if nodes > 1:
        plan.notes.append(f"{report.target} probed; the other {nodes - 1} node(s) taken to be alike")
    check_fits(plan)
    return capacity
