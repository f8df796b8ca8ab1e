"""The launch sections of `spike-replay.yaml`: torchrun across several targets, and Slurm clusters.

```yaml
targets:
  gpu-a: {ssh: "ssh root@10.0.0.5", python: /opt/venv/bin/python}
  gpu-b: {ssh: "ssh root@10.0.0.6", python: /opt/venv/bin/python}
  hpc-login: {ssh: "ssh me@login.hpc", python: /shared/venv/bin/python, setup: ["module load slurm cuda"]}
multinode:                    # one torchrun agent per node, over SSH, one c10d rendezvous
  pair:
    nodes: [gpu-a, gpu-b]     # targets above; the first hosts the rendezvous
    nproc_per_node: 8
    addresses: {gpu-a: 10.0.0.5}  # optional: how the other nodes reach a node (default: its host name)
    rendezvous_port: 29400    # optional (default: a port free on the first node at launch)
    rendezvous_timeout_s: 300 # optional
slurm:                        # sbatch from a login node; srun starts one torchrun agent per allocated node
  hpc:
    login: hpc-login          # a target above, or `local` when this machine is the login node
    partition: gpu
    account: rl-team          # optional
    time: "01:00:00"          # optional: sbatch --time
    nodes: 2
    gpus_per_node: 8
    cpus_per_task: 64         # optional
    job_dir: /shared/scratch/me/axrl-jobs  # on storage the compute nodes share (default ~/.axrl-spike-replay/...)
    sbatch_args: ["--qos=high"]            # optional, further sbatch options
    schedule_timeout_s: 1800  # optional: cancel a job still pending after this
```
Names are unique across `targets`, `multinode` and `slurm`, so one name picks where a run goes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.launchers.launch_job import LaunchNode
from axrl_spike_replay.remote.launchers.slurm_command import SlurmSettings
from axrl_spike_replay.remote.launchers.torchrun_command import DEFAULT_RENDEZVOUS_TIMEOUT_S, is_host_text
from axrl_spike_replay.remote.transport.target_config import TargetConfig, resolve_named

LOCAL_LOGIN = "local"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MULTINODE_KEYS = {"nodes", "nproc_per_node", "addresses", "rendezvous_port", "rendezvous_timeout_s"}
_SLURM_OWN_KEYS = {"login", "python", "setup"}
_SLURM_SETTING_KEYS = {f.name for f in fields(SlurmSettings)} - {"poll_s"}


@dataclass(frozen=True)
class MultiNodeConfig:
    """torchrun across targets: which, how many processes on each, where they meet."""

    name: str
    nodes: tuple[str, ...]
    nproc_per_node: int = 1
    addresses: dict[str, str] = field(default_factory=dict)
    rendezvous_port: int | None = None
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S


@dataclass(frozen=True)
class SlurmConfig:
    """A Slurm cluster: the login node jobs are submitted from, and what each job asks for."""

    name: str
    login: str  # a target name, or "local"
    settings: SlurmSettings
    python: str | None = None  # default: the login target's (or this interpreter when local)
    setup: tuple[str, ...] = ()  # default: the login target's


@dataclass(frozen=True)
class LaunchConfig:
    """The `multinode:` and `slurm:` sections."""

    multinode: dict[str, MultiNodeConfig] = field(default_factory=dict)
    slurm: dict[str, SlurmConfig] = field(default_factory=dict)


def parse_launch_config(doc: dict[str, Any], source: str, targets: dict[str, TargetConfig]) -> LaunchConfig:
    """Validate the launch sections of a loaded `spike-replay.yaml`; errors name the file and the key."""
    multinode = {
        name: _multinode(name, entry, source, targets)
        for name, entry in _section(doc, "multinode", source, targets).items()
    }
    slurm = {
        name: _slurm(name, entry, source, targets) for name, entry in _section(doc, "slurm", source, targets).items()
    }
    clash = set(multinode) & set(slurm)
    if clash:
        raise ConfigError(f"{source}: {', '.join(sorted(clash))} named in both multinode and slurm; use one name each")
    return LaunchConfig(multinode=multinode, slurm=slurm)


class Targets(Protocol):
    """What the launch sections resolve their node names in: the parsed file's `targets` (a `WorkspaceConfig`)."""

    @property
    def targets(self) -> Mapping[str, TargetConfig]: ...


def multinode_nodes(config: MultiNodeConfig, workspace: Targets) -> tuple[LaunchNode, ...]:
    """The nodes of a `multinode:` entry, each with its target's ssh, python and setup lines."""
    return tuple(
        LaunchNode(node, resolve_named(node, workspace.targets), address=config.addresses.get(node))
        for node in config.nodes
    )


def slurm_login(config: SlurmConfig, workspace: Targets) -> LaunchNode:
    """The login node of a `slurm:` entry (python and setup of the entry, else of its target)."""
    target = None if config.login == LOCAL_LOGIN else resolve_named(config.login, workspace.targets)
    return LaunchNode(config.login, target, python=config.python or "", setup=config.setup)


def _section(doc: dict[str, Any], key: str, source: str, targets: dict[str, TargetConfig]) -> dict[str, Any]:
    section = doc.get(key) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: {key} must be a mapping of names to entries")
    for name in section:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ConfigError(f"{source}: {key} name {shown(name)}: use letters, digits and . _ -")
        if name in targets:
            raise ConfigError(f"{source}: {key}.{name}: the name is already a target; use one name each")
        if not isinstance(section[name], dict):
            raise ConfigError(f"{source}: {key}.{name} must be a mapping (key: value)")
    return section


def _multinode(name: str, entry: dict[str, Any], source: str, targets: dict[str, TargetConfig]) -> MultiNodeConfig:
    where = f"multinode.{name}"
    _known(entry, _MULTINODE_KEYS, source, where)
    nodes = entry.get("nodes")
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
        raise ConfigError(f"{source}: {where}.nodes must be a list of target names, e.g. [gpu-a, gpu-b]")
    unknown = [n for n in nodes if n not in targets]
    if unknown:
        raise ConfigError(f"{source}: {where}.nodes: {', '.join(unknown)} not among the targets")
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"{source}: {where}.nodes names a target twice")
    addresses = entry.get("addresses") or {}
    if not isinstance(addresses, dict) or not all(
        a in nodes and isinstance(v, str) and is_host_text(v) for a, v in addresses.items()
    ):
        raise ConfigError(f"{source}: {where}.addresses maps some of its nodes to an address, e.g. {{gpu-a: 10.0.0.5}}")
    port = entry.get("rendezvous_port")
    if port is not None and not (_whole(port) and 0 < port < 65536):
        raise ConfigError(f"{source}: {where}.rendezvous_port must be a port number from 1 to 65535")
    return MultiNodeConfig(
        name=name,
        nodes=tuple(nodes),
        nproc_per_node=_count(entry.get("nproc_per_node", 1), source, f"{where}.nproc_per_node"),
        addresses={str(k): str(v) for k, v in addresses.items()},
        rendezvous_port=port,
        rendezvous_timeout_s=_seconds(
            entry.get("rendezvous_timeout_s", DEFAULT_RENDEZVOUS_TIMEOUT_S), source, f"{where}.rendezvous_timeout_s"
        ),
    )


def _slurm(name: str, entry: dict[str, Any], source: str, targets: dict[str, TargetConfig]) -> SlurmConfig:
    where = f"slurm.{name}"
    _known(entry, _SLURM_OWN_KEYS | _SLURM_SETTING_KEYS, source, where)
    login = entry.get("login")
    if not isinstance(login, str) or (login != LOCAL_LOGIN and login not in targets):
        raise ConfigError(f"{source}: {where}.login must name a target, or be `{LOCAL_LOGIN}` for this machine")
    setup = entry.get("setup") or []
    setup = [setup] if isinstance(setup, str) else setup
    if not isinstance(setup, list) or not all(isinstance(line, str) for line in setup):
        raise ConfigError(f"{source}: {where}.setup must be a list of shell lines")
    values = {key: entry[key] for key in _SLURM_SETTING_KEYS if key in entry}
    if "sbatch_args" in values:
        args = values["sbatch_args"]
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConfigError(f"{source}: {where}.sbatch_args must be a list of sbatch options")
        values["sbatch_args"] = tuple(args)
    if "time" in values and not isinstance(values["time"], str):  # YAML reads 1:30:00 as the number 5400
        raise ConfigError(f'{source}: {where}.time: write it quoted, e.g. time: "01:30:00" (or "90" for minutes)')
    for key in ("partition", "account", "job_dir"):
        if key in values and not isinstance(values[key], str):
            values[key] = str(values[key])
    python = entry.get("python")
    if python is not None and (not isinstance(python, str) or not python.strip()):
        raise ConfigError(f"{source}: {where}.python must be a path or command name")
    try:
        settings = SlurmSettings(**values)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {where}: {exc}") from None
    except TypeError as exc:  # a value of the wrong kind the checks above did not cover
        raise ConfigError(f"{source}: {where}: {exc}") from None
    return SlurmConfig(name=name, login=login, settings=settings, python=python, setup=tuple(setup))


def _known(entry: dict[str, Any], allowed: set[str], source: str, where: str) -> None:
    unknown = sorted(str(k) for k in entry if k not in allowed)
    if unknown:
        raise ConfigError(
            f"{source}: {where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any, source: str, where: str) -> int:
    if not _whole(value) or value < 1:
        raise ConfigError(f"{source}: {where} must be a whole number of at least 1, got {shown(value)}")
    return value


def _seconds(value: Any, source: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{source}: {where} must be a positive number of seconds, got {shown(value)}")
    return float(value)
