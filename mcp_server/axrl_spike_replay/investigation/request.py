"""One replay request, built and validated in one place; the CLI and MCP faces only fill its parts.

A request is three parts and where it is recorded: `What` to replay (the verb, the snapshot, mitigations and
repeats; a sweep's configs; an attribution's top and method), `Where` it runs (here, an SSH target, the
trainer's own command, and how to reach the node) and `How` (processes, device, pools). `replay_request`
checks every field and every combination of them before anything connects or is written, and gives the
vocabulary fields as members (`Verb`, `Backend`, `Device`, `Method`). Adding an option is one field in its
part and one check here. `request_document` / `request_of_document` carry a request as JSON (the CLI's warm
service).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.vocabulary import Backend, Device, Method, Shard, Verb, Vocabulary

LOCAL = "local"  # the target that means this machine

_V = TypeVar("_V", bound=Vocabulary)
MAX_REPEAT = 100  # a determinism check needs a handful of recomputations; each one is a whole replay
_HERE = (Backend.TORCH, Backend.MEGATRON)  # backends the built-in engine runs in this process tree


@dataclass(frozen=True)
class What:
    """What to replay: the verb and snapshot; mitigations and repeats (replay), configs (sweep), top and method
    (attribute), and the verdicts' threshold."""

    snapshot: Path
    _: KW_ONLY
    verb: Verb = Verb.REPLAY
    mitigations: Mapping[str, Any] = field(default_factory=dict)  # one config {name: value}, normalised
    repeat: int = 1
    configs: tuple[Mapping[str, Any], ...] = ()  # sweep: the configs to compare, normalised and distinct
    clear_threshold: float | None = None  # replay/sweep: spike-ratio threshold for verdicts (None: the detector's)
    top: int = 10  # attribute: samples to list
    method: Method = Method.JVP  # attribute: jvp | per_sample_backward


@dataclass(frozen=True, kw_only=True)
class Where:
    """Where it runs: here (`local`) or an SSH target, with the built-in engine or the trainer's own command."""

    target: str = LOCAL  # "local", an SSH target (a spike-replay.yaml name or as typed), or a multinode/slurm entry
    targets: tuple[str, ...] = ()  # several SSH nodes: one torchrun agent on each, one rendezvous
    # Slurm: sbatch from `target` as the login node ("local": this machine), with these settings over those of the
    # slurm: entry `target` names (partition, account, time, nodes, gpus_per_node, nproc_per_node, cpus_per_task, ...)
    slurm: Mapping[str, Any] | None = None
    backend: Backend = Backend.TORCH  # torch (built-in engine) | command (the workspace's external replay command)
    patches: tuple[str, ...] = ()  # unified diffs applied in order in a temporary worktree (command backend)
    remote_python: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    timeout_s: float | None = None  # kill the run (its process group) after this many seconds


@dataclass(frozen=True, kw_only=True)
class How:
    """How it computes: replay processes, device, and pools running a sweep's configs side by side."""

    nproc: int | None = None  # None: the saved world size (full fidelity)
    device: Device = Device.CPU
    parallel_configs: int | None = None  # sweep: pools running configs side by side (None: 1 on CPU, GPUs/nproc)
    shard: Shard = Shard.AUTO  # FSDP2 over the processes: auto (when the model does not fit one) | on | off


@dataclass(frozen=True, kw_only=True)
class ReplayRequest:
    """What to replay, where and how, and where it is recorded. Build it with `replay_request`, which validates it."""

    what: What
    where: Where = field(default_factory=Where)
    how: How = field(default_factory=How)
    # recorded where
    workspace: Path | None = None  # None: nothing is written
    job: str | None = None  # default: the snapshot's job name
    command: str | None = None  # the command line for command.txt (default: the equivalent CLI)
    progress: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    cancel: threading.Event | None = field(default=None, compare=False, repr=False)  # set: stop the run

    @property
    def runs_here(self) -> bool:
        """True for the built-in engine on this machine (its torch models, or Megatron-core's GPTModel with
        `backend` megatron); False for a node, launched processes (several nodes, Slurm) or the command backend."""
        where = self.where
        return where.backend in _HERE and where.target == LOCAL and not where.targets and where.slurm is None

    @property
    def launched(self) -> bool:
        """True when the engine runs here and torchrun starts its processes on several nodes or under Slurm."""
        return launch_kind(self.where, self.workspace) is not None


def replay_request(
    what: What,
    where: Where | None = None,
    how: How | None = None,
    *,
    workspace: str | Path | None = None,
    job: str | None = None,
    command: str | None = None,
    progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
) -> ReplayRequest:
    """The validated request for a replay, sweep or attribution; ConfigError (naming the parameter) otherwise.

    The parts may hold plain strings for their vocabulary fields (`device="cuda"`); the request holds members."""
    from axrl_spike_replay.experiment.mitigations import check_distinct, parse_config

    where, how = where or Where(), how or How()
    verb = _member(Verb, what.verb, "verb", None)
    backend = _member(Backend, where.backend, "`backend`", "backend")
    device = _member(Device, how.device, "`device`", "device")
    shard = _member(Shard, how.shard, "`shard`", "shard")
    _check(how.nproc, what.repeat, what.top)
    method = _member(Method, what.method, "`method`", "method")
    _check_timeout(where.timeout_s)
    target, targets = _targets(where.target, where.targets)
    slurm = _slurm_settings(where.slurm)
    patches = _patch_set(where.patches)
    placed = replace(where, target=target, targets=targets, slurm=slurm)
    launched = launch_kind(placed, Path(workspace) if workspace is not None else None) is not None
    _check_combination(verb, target, backend, patches, where.timeout_s, launched or bool(targets) or slurm is not None)
    _check_megatron(verb, what, device, target, backend, launched or bool(targets) or slurm is not None)
    _check_clear_threshold(what.clear_threshold, verb, target, backend, launched)
    _check_parallel_configs(how.parallel_configs, verb, target, backend)
    _check_shard(shard, verb, backend)
    if verb == Verb.ATTRIBUTE and shard == Shard.OFF and how.nproc not in (None, 1):
        raise ConfigError(
            "`nproc`: an unsharded attribution runs in this one process; shard it (`shard` on) to use more", "nproc"
        )
    normalised = tuple(parse_config(c, f"config {i + 1}") for i, c in enumerate(what.configs))
    if verb == Verb.SWEEP:
        check_distinct(normalised)
    return ReplayRequest(
        what=replace(
            what,
            snapshot=Path(what.snapshot),
            verb=verb,
            mitigations=parse_config(what.mitigations) if what.mitigations else {},
            configs=normalised,
            clear_threshold=float(what.clear_threshold) if what.clear_threshold is not None else None,
            method=method,
        ),
        where=replace(
            placed,
            backend=backend,
            patches=patches,
            known_hosts=str(where.known_hosts) if where.known_hosts else None,
            accept_new_host_key=bool(where.accept_new_host_key),
        ),
        how=replace(how, device=device, shard=shard),
        workspace=Path(workspace) if workspace is not None else None,
        job=job,
        command=command,
        progress=progress,
        cancel=cancel,
    )


def request_document(request: ReplayRequest) -> dict[str, Any]:
    """The request as a JSON document: its parts and where it is recorded (progress and cancel stay behind)."""
    doc: dict[str, Any] = {name: asdict(getattr(request, name)) for name in ("what", "where", "how")}
    doc["what"]["snapshot"] = str(request.what.snapshot)
    doc |= {"workspace": str(request.workspace) if request.workspace is not None else None}
    doc |= {"job": request.job, "command": request.command}
    return to_jsonable(doc)


def request_of_document(
    doc: Mapping[str, Any], progress: Callable[[str], None] | None = None, cancel: threading.Event | None = None
) -> ReplayRequest:
    """The validated request a `request_document` describes; ConfigError naming what is wrong otherwise."""
    parts = {"what": What, "where": Where, "how": How}
    unknown = sorted(set(doc) - {*parts, "workspace", "job", "command"})
    if unknown:
        raise ConfigError(f"the request has unknown field(s) {', '.join(shown(u) for u in unknown[:5])}")
    values: dict[str, Any] = {}
    for name, part in parts.items():
        given = doc.get(name) or {}
        known = {f.name for f in fields(part)} - {"_"}
        if not isinstance(given, Mapping) or set(given) - known:
            extra = sorted(set(given) - known) if isinstance(given, Mapping) else [type(given).__name__]
            raise ConfigError(f"the request's `{name}` has unknown field(s) {', '.join(map(str, extra[:5]))}")
        values[name] = dict(given)
    snapshot = values["what"].pop("snapshot", None)
    if not isinstance(snapshot, str) or not snapshot:
        raise ConfigError("the request names no snapshot", "snapshot")
    values["what"]["configs"] = tuple(values["what"].get("configs") or ())
    values["where"]["patches"] = tuple(values["where"].get("patches") or ())
    values["where"]["targets"] = tuple(values["where"].get("targets") or ())
    return replay_request(
        What(Path(snapshot), **values["what"]),
        Where(**values["where"]),
        How(**values["how"]),
        workspace=doc.get("workspace"),
        job=doc.get("job"),
        command=doc.get("command"),
        progress=progress,
        cancel=cancel,
    )


def _member(vocabulary: type[_V], value: Any, what: str, parameter: str | None) -> _V:
    """The member whose value `value` is; ConfigError naming the parameter and the allowed values otherwise."""
    try:
        return vocabulary.parse(value, what)
    except AxrlError:
        raise ConfigError(
            f"{what} must be one of {', '.join(vocabulary.values())}, got {shown(value)}", parameter
        ) from None


def _check(nproc: Any, repeat: Any, top: Any) -> None:
    """The counts, each on its own."""
    if nproc is not None and (not _is_int(nproc) or nproc < 1):
        raise ConfigError(f"`nproc` must be an integer >= 1, got {shown(nproc)}", "nproc")
    if not _is_int(repeat) or not 1 <= repeat <= MAX_REPEAT:
        raise ConfigError(f"`repeat` must be an integer from 1 to {MAX_REPEAT}, got {shown(repeat)}", "repeat")
    if not _is_int(top) or top < 1:
        raise ConfigError(f"`top` must be an integer >= 1, got {shown(top)}", "top")


def _check_timeout(timeout_s: Any) -> None:
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
    ):
        raise ConfigError(f"`timeout_s` must be a positive number of seconds, got {shown(timeout_s)}", "timeout_s")


def _patch_set(patches: Any) -> tuple[str, ...]:
    """The patch set as one ordered tuple of path strings (a single path counts as a set of one)."""
    if patches is None or patches == "":
        return ()
    items: Sequence[Any] = [patches] if isinstance(patches, (str, Path)) else list(patches)
    for item in items:
        if not isinstance(item, (str, Path)) or not str(item).strip():
            raise ConfigError(f"`patch` must be the path of a unified diff file, got {shown(item)}", "patch")
    return tuple(str(item) for item in items)


def launch_kind(where: Where, workspace: Path | None) -> str | None:
    """ "torchrun" when the run's processes are torchrun agents on several SSH nodes (`targets`, or a `multinode:`
    entry of the workspace's spike-replay.yaml named as `target`), "slurm" for a Slurm allocation (`slurm`
    settings, or a `slurm:` entry), None otherwise (here, one node, the command backend)."""
    if where.backend == Backend.COMMAND:
        return None
    if where.slurm is not None:
        return "slurm"
    if len(where.targets) > 1:
        return "torchrun"
    if where.target == LOCAL:
        return None
    from axrl_spike_replay.remote.workspace_config import load_workspace_config

    launch = load_workspace_config(workspace if workspace is not None else Path(".")).launch
    if launch is not None and where.target in launch.slurm:
        return "slurm"
    if launch is not None and where.target in launch.multinode:
        return "torchrun"
    return None


def _targets(target: Any, targets: Any) -> tuple[str, tuple[str, ...]]:
    """(target, targets): one node given in `targets` is the `target`; both at once are refused."""
    target = target or LOCAL
    items = [targets] if isinstance(targets, str) else list(targets or ())
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"`targets` must be SSH targets or target names, got {shown(item)}", "targets")
    if len(set(items)) != len(items):
        raise ConfigError(f"`targets` names a node twice: {shown(items)}", "targets")
    if items and target != LOCAL:
        raise ConfigError(
            "give `target` (one node or a configured group) or `targets` (several nodes), not both", "targets"
        )
    if len(items) == 1:
        return items[0], ()
    return target, tuple(items)


def _slurm_settings(slurm: Any) -> dict[str, Any] | None:
    """The Slurm settings given with the request (checked as sbatch will get them), or None."""
    if slurm is None:
        return None
    if not isinstance(slurm, Mapping):
        raise ConfigError(f"`slurm` must be a mapping of Slurm settings, got {shown(slurm)}", "slurm")
    from axrl_spike_replay.remote.slurm_command import SlurmSettings

    allowed = {f.name for f in fields(SlurmSettings)} - {"poll_s"}
    unknown = sorted(str(k) for k in slurm if k not in allowed)
    if unknown:
        raise ConfigError(
            f"`slurm`: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}", "slurm"
        )
    values: dict[str, Any] = {str(k): tuple(v) if isinstance(v, list) else v for k, v in slurm.items() if v is not None}
    try:
        SlurmSettings(**values)
    except ConfigError as exc:
        raise ConfigError(f"`slurm`: {exc}", "slurm") from None
    except TypeError as exc:
        raise ConfigError(f"`slurm`: {exc}", "slurm") from None
    return values


def _check_combination(
    verb: Verb, target: str, backend: Backend, patches: tuple[str, ...], timeout_s: Any, launched: bool
) -> None:
    """Options that cannot work together, refused before anything connects or is written. (Which mitigations
    the command backend can run is the workspace's `spike-replay.yaml`'s to say: `investigation.elsewhere`.)"""
    if verb == Verb.ATTRIBUTE and (target != LOCAL or backend != Backend.TORCH or launched):
        raise ConfigError("`target`: attribution runs here with the built-in torch engine", "target")
    if launched and backend == Backend.COMMAND:
        raise ConfigError(
            "`backend` command runs the trainer's replay command on one node; several nodes and Slurm run the "
            "built-in torch engine",
            "backend",
        )
    if backend != Backend.COMMAND and patches:
        raise ConfigError(
            "`patch` applies to the training checkout the command backend runs; add `backend` command", "patch"
        )
    if target == LOCAL and backend in _HERE and timeout_s is not None and not launched:
        raise ConfigError("`timeout_s` applies to runs on a `target` or with `backend` command", "timeout_s")


def _check_megatron(verb: Verb, what: What, device: Device, target: str, backend: Backend, launched: bool) -> None:
    """`backend` megatron (route 2 of a Megatron snapshot) replays the baseline here, on CPU; the rest is route 1's."""
    if backend != Backend.MEGATRON:
        return
    if verb != Verb.REPLAY:
        raise ConfigError(
            f"`backend` megatron replays the baseline; a {verb} runs on the built-in `backend` torch", "backend"
        )
    if what.mitigations:
        raise ConfigError(
            "`backend` megatron replays the baseline; mitigations run on the built-in `backend` torch (route 1)",
            "mitigation",
        )
    if target != LOCAL or launched:
        raise ConfigError(
            "`backend` megatron runs Megatron-core's GPTModel here, on CPU; a `target` runs the torch or command "
            "backend",
            "target",
        )
    if device != Device.CPU:
        raise ConfigError(
            "`backend` megatron runs Megatron-core's GPTModel with the local spec on CPU here; use `device` cpu",
            "device",
        )


def _check_clear_threshold(value: Any, verb: Verb, target: str, backend: Backend, launched: bool) -> None:
    """The user's verdict threshold: a finite ratio > 0, for replays and sweeps of the local torch engine."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"`clear_threshold` must be a finite spike ratio > 0 (grad norm / median), got {shown(value)}",
            "clear_threshold",
        )
    if verb == Verb.ATTRIBUTE:
        raise ConfigError(
            "`clear_threshold` judges replays and sweeps; attribution gives no verdict", "clear_threshold"
        )
    if (target != LOCAL or backend not in _HERE) and not launched:
        raise ConfigError(
            "`clear_threshold` applies to the built-in engine run here (its processes here, on several nodes or "
            "under Slurm); a run on one `target` node or with `backend` command is judged by the snapshot's detector "
            "threshold",
            "clear_threshold",
        )


def _check_shard(shard: Shard, verb: Verb, backend: Backend) -> None:
    """Sharding is the built-in engine's (an attribution shards too: one backward per sample over the shards)."""
    if shard == Shard.ON and backend == Backend.COMMAND:
        raise ConfigError(
            "`shard` applies to the built-in torch engine; the trainer's own command shards as it does", "shard"
        )


def _check_parallel_configs(value: Any, verb: Verb, target: str, backend: Backend) -> None:
    """Pools for a sweep's configs: an integer >= 1, for sweeps of the built-in torch engine run here."""
    if value is None:
        return
    if not _is_int(value) or value < 1:
        raise ConfigError(f"`parallel_configs` must be an integer >= 1, got {shown(value)}", "parallel_configs")
    if verb != Verb.SWEEP or target != LOCAL or backend != Backend.TORCH:
        raise ConfigError(
            "`parallel_configs` spreads a sweep's configs over pools of the built-in torch engine run here",
            "parallel_configs",
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
