"""One replay request, built and validated in one place; the CLI and MCP faces only fill its parts.

A request is three parts and where it is recorded, each field declared once in `experiment.request.request_parts`:
`What` to replay (the verb, the snapshot, mitigations and repeats; a sweep's configs; an attribution's top and
method), `Where` it runs (here, an SSH target, the trainer's own command, and how to reach the node) and `How`
(processes, device, pools). `replay_request` checks every field and every combination of them before anything
connects or is written, and gives the vocabulary fields as members (`Verb`, `Backend`, `Device`, `Method`). A
field's declaration (`request_fields.declare`: its summary, help, bounds or choices, and the verbs that take it)
gives the CLI's options, the MCP tools' parameter schemas and the value checks here, so adding a simple option is
one declared field and its use; a combination of fields is checked here, by name. The engine takes the request as
it is. `request_document` / `request_of_document` carry a request as JSON (the CLI's warm service).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.request.request_fields import check_declared, declared_fields, refuse_uncarried
from axrl_spike_replay.experiment.request.request_parts import (
    HERE_BACKENDS,
    LOCAL,
    How,
    ReplayRequest,
    What,
    Where,
)
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.vocabulary import Backend, Device, Shard, Verb, Vocabulary

_V = TypeVar("_V", bound=Vocabulary)
_P = TypeVar("_P", "What", "Where", "How")


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
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_config

    verb = _member(Verb, what.verb, "verb", None)
    what, where, how = _checked(what), _checked(where or Where()), _checked(how or How())
    backend, device, shard, method = where.backend, how.device, how.shard, what.method
    target, targets = _targets(where.target, where.targets)
    slurm = _slurm_settings(where.slurm)
    patches = _patch_set(where.patches)
    placed = replace(where, target=target, targets=targets, slurm=slurm)
    launched = launch_kind(placed, Path(workspace) if workspace is not None else None) is not None
    _check_combination(verb, target, backend, patches, launched or bool(targets) or slurm is not None)
    _check_megatron(verb, what, device, target, backend, launched or bool(targets) or slurm is not None)
    _check_clear_threshold(what.clear_threshold, verb, target, backend, launched)
    _check_parallel_configs(how.parallel_configs, verb, target, backend)
    _check_shard(shard, verb, backend)
    _check_streamed(shard, verb, how.nproc, launched or bool(targets) or slurm is not None)
    refuse_uncarried(what, backend)  # every other field the backend would not carry, by name
    refuse_uncarried(how, backend)
    if verb == Verb.ATTRIBUTE and shard == Shard.OFF and how.nproc not in (None, 1):
        raise ConfigError(
            "`nproc`: an unsharded attribution runs in this one process; shard it (`shard` on) to use more", "nproc"
        )
    if verb == Verb.SWEEP:
        normalised, refused = sweep_configs(what.configs, what.refused)
    else:
        normalised, refused = tuple(parse_config(c, f"config {i + 1}") for i, c in enumerate(what.configs)), ()
    return ReplayRequest(
        what=replace(
            what,
            snapshot=Path(what.snapshot),
            verb=verb,
            mitigations=parse_config(what.mitigations) if what.mitigations else {},
            configs=normalised,
            refused=refused,
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


def sweep_configs(
    configs: Sequence[Any], refused: Sequence[Sequence[Any]] = ()
) -> tuple[tuple[dict[str, Any], ...], tuple[tuple[int, Mapping[str, Any], str], ...]]:
    """(the configs the checks accept, normalised and distinct; those they refuse: (place among the configs as given,
    the config as given, why)). A sweep runs around a refused config and reports it; ConfigError when every config is
    refused (one: its own error), when a config is no mapping or empty, or when two are the same. `refused`: those a
    request already refused (a request read back from its document), put back in their places."""
    from axrl_spike_replay.experiment.mitigation.mitigations import check_distinct, normal_form, parse_config

    given: list[Any] = list(configs)
    for place, config, _ in sorted((int(r[0]), r[1], r[2]) for r in refused):
        given.insert(place, config)
    kept: list[dict[str, Any]] = []
    every: list[dict[str, Any]] = []  # each config in normal form, refused ones as written: none twice
    out: list[tuple[int, Mapping[str, Any], str]] = []
    errors: list[ConfigError] = []
    for place, config in enumerate(given):
        if not isinstance(config, Mapping):
            parse_config(config, f"config {place + 1}")  # raises: the sweep cannot name what it would run
        try:
            kept.append(parse_config(config, f"config {place + 1}"))
            every.append(kept[-1])
        except ConfigError as exc:
            errors.append(exc)
            out.append((place, dict(config), str(exc).splitlines()[0]))  # the list of valid names stays in the docs
            every.append(normal_form(config))
    if not kept and errors:  # a sweep of no configs refuses none (not an IndexError)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(
            "every config of the sweep is refused: " + "; ".join(f"config {p + 1}: {why}" for p, _, why in out),
            errors[0].parameter,
        )
    check_distinct(every)
    return tuple(kept), tuple(out)


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
    values["what"]["refused"] = tuple(tuple(r) for r in values["what"].get("refused") or ())
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


def _checked(part: _P) -> _P:
    """`part` with each declared value checked against its declaration (bounds, choices), choices as members."""
    values = {name: check_declared(name, d, getattr(part, name)) for name, d, _ in declared_fields(type(part))}
    return replace(part, **values)


def _patch_set(patches: Any) -> tuple[str, ...]:
    """The patch set as one ordered tuple of path strings (a single path counts as a set of one)."""
    if patches is None or patches == "":
        return ()
    items: Sequence[Any] = [patches] if isinstance(patches, (str, Path)) else list(patches)
    for item in items:
        if not isinstance(item, (str, Path)) or not str(item).strip():
            raise ConfigError(f"`patch` must be the path of a unified diff file, got {shown(item)}", "patch")
    return tuple(str(item) for item in items)


def launched(request: ReplayRequest) -> bool:
    """True when the engine runs here and torchrun starts its processes on several nodes or under Slurm."""
    return launch_kind(request.where, request.workspace) is not None


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
    from axrl_spike_replay.remote.launchers.slurm_command import SlurmSettings

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


def _check_combination(verb: Verb, target: str, backend: Backend, patches: tuple[str, ...], launched: bool) -> None:
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
            "mitigations",
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
    """The user's verdict threshold (its value checked by its declaration): for replays and sweeps of the local
    torch engine."""
    if value is None:
        return
    if verb == Verb.ATTRIBUTE:
        raise ConfigError(
            "`clear_threshold` judges replays and sweeps; attribution gives no verdict", "clear_threshold"
        )
    if (target != LOCAL or backend not in HERE_BACKENDS) and not launched:
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
    if shard == Shard.STREAMED and backend == Backend.MEGATRON:
        raise ConfigError(
            "`shard` streamed replays a Megatron snapshot on route 1 (its checkpoint in the transformers model, "
            "`backend` torch); `backend` megatron runs Megatron-core's GPTModel whole",
            "shard",
        )


def _check_streamed(shard: Shard, verb: Verb, nproc: int | None, launched: bool) -> None:
    """A streamed replay or attribution runs on this machine's processes (the saved ranks split over `nproc`, bounded
    by the saved world size where the snapshot is read)."""
    if shard != Shard.STREAMED:
        return
    if nproc is not None and nproc < 1:
        raise ConfigError(f"`nproc`: a streamed replay runs on 1 or more processes, not {nproc}", "nproc")
    if launched:
        raise ConfigError("`shard` streamed runs on this machine's processes, not launched over nodes", "shard")


def _check_parallel_configs(value: Any, verb: Verb, target: str, backend: Backend) -> None:
    """Pools for a sweep's configs (their number checked by its declaration): for sweeps of the built-in torch
    engine run here."""
    if value is None:
        return
    if verb != Verb.SWEEP or target != LOCAL or backend != Backend.TORCH:
        raise ConfigError(
            "`parallel_configs` spreads a sweep's configs over pools of the built-in torch engine run here",
            "parallel_configs",
        )
