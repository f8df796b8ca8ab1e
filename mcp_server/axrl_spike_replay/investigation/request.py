"""One replay request, built and validated in one place; the CLI and MCP faces only fill its parts.

A request is three parts and where it is recorded: `What` to replay (the verb, the snapshot, mitigations and
repeats; a sweep's configs; an attribution's top and method), `Where` it runs (here, an SSH target, the
trainer's own command, and how to reach the node) and `How` (processes, device, pools). `replay_request`
checks every field and every combination of them before anything connects or is written, and gives the
vocabulary fields as members (`Verb`, `Backend`, `Device`, `Method`). Each field is declared once
(`request_fields.declare`: its summary, help, bounds or choices, and the verbs that take it); the CLI's options,
the MCP tools' parameter schemas and the value checks here come from that declaration, so adding a simple option
is one declared field and its use; a combination of fields is checked here, by name.
`request_document` / `request_of_document` carry a request as JSON (the CLI's warm service).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.investigation.request_fields import check_declared, declare, declared_fields
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.vocabulary import Backend, Device, Method, Shard, Verb, Vocabulary

LOCAL = "local"  # the target that means this machine

_V = TypeVar("_V", bound=Vocabulary)
_P = TypeVar("_P", "What", "Where", "How")
MAX_REPEAT = 100  # a determinism check needs a handful of recomputations; each one is a whole replay
_HERE = (Backend.TORCH, Backend.MEGATRON)  # backends the built-in engine runs in this process tree


_REPLAY_SWEEP = (Verb.REPLAY, Verb.SWEEP)


@dataclass(frozen=True)
class What:
    """What to replay: the verb and snapshot; mitigations and repeats (replay), configs (sweep), top and method
    (attribute), and the verdicts' threshold."""

    snapshot: Path = field(
        metadata=declare(
            summary="Snapshot dir iter_<N> (the preserved copy).",
            help="A snapshot directory `.../checkpoints/spike_snapshots[-active]/iter_<N>`, absolute or relative to "
            "the workspace. Prefer the preserved copy under `spike_snapshots-active` (preserving the snapshot makes "
            "it): the trainer's rotation deletes the original.",
            cli=False,  # the CLI's positional argument
        )
    )
    _: KW_ONLY
    verb: Verb = Verb.REPLAY
    mitigations: Mapping[str, Any] = field(
        default_factory=dict,
        metadata=declare(  # one config {name: value}, normalised
            summary="One config {NAME: VALUE}; {} = baseline; 'VALUE@RANKS' on a loss setting = a hypothesis. Names "
            "and values: axrl://mitigations.",
            help="One mitigation config `{NAME: VALUE}`; empty is the baseline replay. The names, their values and "
            "what each changes: resource axrl://mitigations. A loss setting scoped to saved ranks, `{'aux_loss_coef': "
            "'10.24@1'}`, is a hypothesis about what those ranks computed: it is judged against the recording as the "
            "baseline is (grad norm and every rank's loss), and its `finding` says 'reproduced under ...' or not.",
            verbs=(Verb.REPLAY, Verb.ATTRIBUTE),
            cli=False,  # --mitigation NAME=VALUE, repeated
        ),
    )
    repeat: int = field(
        default=1,
        metadata=declare(
            summary="Recompute this many times (the spread).",
            help=f"Recompute the step this many times (at most {MAX_REPEAT}) and report the spread of the grad norms: "
            "a determinism check.",
            kind="int",
            ge=1,
            le=MAX_REPEAT,
            verbs=(Verb.REPLAY,),
        ),
    )
    configs: tuple[Mapping[str, Any], ...] = field(
        default=(),
        metadata=declare(  # sweep: the configs to compare, normalised and distinct
            summary="Configs to compare, each {NAME: VALUE} (names as for replay); the baseline always runs.",
            help="Mitigation configs to compare, each `{NAME: VALUE, ...}`, distinct and none empty (the baseline "
            "always runs). Loss-level configs share one forward pass.",
            verbs=(Verb.SWEEP,),
            cli=False,  # --mitigation-set FILE or --mitigation per config
        ),
    )
    clear_threshold: float | None = field(
        default=None,
        metadata=declare(
            summary="Spike ratio verdicts use; default: the detector's.",
            help="The spike ratio (grad norm / median) verdicts use: a mitigation clears the spike under it, the "
            "baseline is a spike at or above it. Default: the snapshot's detector threshold.",
            kind="float",
            gt=0,
            finite=True,
            must="a finite spike ratio > 0 (grad norm / median)",
            verbs=_REPLAY_SWEEP,
            metavar="X",
        ),
    )
    top: int = field(
        default=10,
        metadata=declare(
            summary="How many samples to list.",
            help="How many samples to list, the largest contribution first.",
            kind="int",
            ge=1,
            verbs=(Verb.ATTRIBUTE,),
            metavar="N",
        ),
    )
    method: Method = field(
        default=Method.JVP,
        metadata=declare(
            summary="jvp (one pass) or per_sample_backward (a check).",
            help="How each sample's contribution is computed: jvp, one forward-mode pass for all samples; or "
            "per_sample_backward, one backward per sample (slower, a cross-check of jvp). A sharded attribution "
            "always takes one backward per sample.",
            kind="choice",
            choices=Method,
            verbs=(Verb.ATTRIBUTE,),
        ),
    )


@dataclass(frozen=True, kw_only=True)
class Where:
    """Where it runs: here (`local`) or an SSH target, with the built-in engine or the trainer's own command."""

    # "local", an SSH target (a spike-replay.yaml name or as typed), or a multinode/slurm entry
    target: str = field(
        default=LOCAL,
        metadata=declare(
            summary="Node to run on over SSH, as typed; omit: here.",
            help="The GPU node to run on, as typed: `ssh -p 26461 root@10.100.4.23`, `user@host:port`, "
            "`ssh://user@host:port`, a ~/.ssh/config alias, or a target name from the workspace's spike-replay.yaml. "
            "The snapshot must be at the same path there (shared storage). Omit it to run here.",
            verbs=_REPLAY_SWEEP,
            cli=False,  # --target, repeated for several nodes (`targets`)
        ),
    )
    targets: tuple[str, ...] = field(
        default=(),
        metadata=declare(  # several SSH nodes: one torchrun agent on each, one rendezvous
            summary="Nodes for one multi-node job.",
            help="Several nodes to run one replay on (each as for `target`): one torchrun agent on each, one c10d "
            "rendezvous on the first, results gathered on rank 0; `nproc` spreads evenly over them. Every node must "
            "see the snapshot at the same path. A `multinode:` entry of spike-replay.yaml named as `target` does the "
            "same.",
            verbs=_REPLAY_SWEEP,
            cli=False,
        ),
    )
    # Slurm: sbatch from `target` as the login node ("local": this machine), with these settings over those of the
    # slurm: entry `target` names (partition, account, time, nodes, gpus_per_node, nproc_per_node, cpus_per_task, ...)
    slurm: Mapping[str, Any] | None = field(
        default=None,
        metadata=declare(
            summary="Run as a Slurm job: {partition, time, nodes, ...}.",
            help="Run as a Slurm job (sbatch, then srun -> torchrun on each allocated node), submitted from `target` "
            "as the login node (omit `target`: this machine). Settings: partition, account, time (HH:MM:SS), nodes, "
            "gpus_per_node, nproc_per_node, cpus_per_task, job_dir, sbatch_args, schedule_timeout_s; they override "
            "those of the `slurm:` entry `target` names. Cancelling the call, and `timeout_s`, scancel the job.",
            verbs=_REPLAY_SWEEP,
            cli=False,  # --slurm and one option per setting
        ),
    )
    backend: Backend = field(
        default=Backend.TORCH,
        metadata=declare(  # torch (built-in engine) | command (the workspace's external replay command)
            summary="Engine: built-in, Megatron-core, or the node's command.",
            help="torch: the built-in engine. megatron: Megatron-core's own GPTModel recomputes the baseline of a "
            "Megatron snapshot here (replay only, no mitigations; needs the megatron extra), the cross-check of "
            "torch. command: the node's own replay command from spike-replay.yaml, for trainers the engine cannot "
            "rebuild (e.g. TP/PP/EP > 1); mitigations run as the trainer's own overrides, mapped in "
            "spike-replay.yaml's command_backend.mitigations (an unmapped one is refused by name), optionally with "
            "`patch`.",
            kind="choice",
            choices=Backend,
            verbs=_REPLAY_SWEEP,
        ),
    )
    patches: tuple[str, ...] = field(
        default=(),
        metadata=declare(  # unified diffs applied in order in a temporary worktree (command backend)
            summary="Diffs for the command backend, in order.",
            help="Unified diffs (file paths) applied in this order in one temporary git worktree of the node's "
            "training checkout (backend command), for this run only; the checkout itself is never modified, and a "
            "diff that does not apply fails the run by name before anything runs. The patched code runs on the node "
            "as its SSH user: it can do whatever that user can.",
            verbs=_REPLAY_SWEEP,
            cli=False,  # --patch, repeated
        ),
    )
    remote_python: str | None = field(
        default=None,
        metadata=declare(
            summary="The node's Python.",
            help="The node's Python interpreter. Default: spike-replay.yaml's, else python3.",
            verbs=_REPLAY_SWEEP,
            metavar="PATH",
        ),
    )
    known_hosts: str | None = field(
        default=None,
        metadata=declare(
            summary="",
            help="The known_hosts file to verify the node's host key against. Default: UserKnownHostsFile of the ssh "
            "config, else ~/.ssh/known_hosts.",
            verbs=_REPLAY_SWEEP,
            metavar="FILE",
            mcp=False,  # a server verifies against its own user's known hosts
        ),
    )
    accept_new_host_key: bool = field(
        default=False,
        metadata=declare(
            summary="Record a new host key the user confirmed.",
            help="Record the host key of a node not yet in known_hosts (as OpenSSH's accept-new does), only after the "
            "user confirmed its fingerprint. A changed key is always refused.",
            kind="bool",
            verbs=_REPLAY_SWEEP,
        ),
    )
    timeout_s: float | None = field(
        default=None,
        metadata=declare(  # kill the run (its process group) after this many seconds
            summary="Stop the run after this many seconds.",
            help="Kill the run, its whole process group (or its Slurm job), after this many seconds; partial logs are "
            "kept.",
            kind="float",
            gt=0,
            must="a positive number of seconds",
            verbs=_REPLAY_SWEEP,
            flag="--timeout",
            metavar="SECONDS",
        ),
    )


@dataclass(frozen=True, kw_only=True)
class How:
    """How it computes: replay processes, device, and pools running a sweep's configs side by side."""

    nproc: int | None = field(
        default=None,
        metadata=declare(  # None: the saved world size (full fidelity)
            summary="Processes; default: the saved world size.",
            help="Replay processes. Default: the saved world size. Fewer: each process replays several saved "
            "ranks in turn, still every saved rank (full fidelity), judged at the tolerance of sums in another order.",
            kind="int",
            ge=1,
        ),
    )
    device: Device = field(
        default=Device.CPU,
        metadata=declare(
            summary="",
            help="Where the replay processes compute: cpu, or cuda (one GPU per process).",
            kind="choice",
            choices=Device,
        ),
    )
    parallel_configs: int | None = field(
        default=None,
        metadata=declare(  # sweep: pools running configs side by side (None: 1 on CPU, GPUs/nproc)
            summary="Pools running the configs side by side.",
            help="Run a sweep's configs on this many pools of `nproc` processes side by side, each also computing the "
            "baseline; the results are those of one pool. Default: 1 on CPU; on CUDA as many pools as the GPUs hold. "
            "Built-in torch engine, run here only.",
            kind="int",
            ge=1,
            verbs=(Verb.SWEEP,),
            metavar="N",
            schema_bounds=False,  # the request's refusal names `parallel_configs`, as for the CLI
        ),
    )
    shard: Shard = field(
        default=Shard.AUTO,
        metadata=declare(  # FSDP2 over the processes: auto (when the model does not fit one) | on | off
            summary="Shard the model over the processes (FSDP2).",
            help="Shard the policy over the replay's processes with FSDP2: each holds 1/N of the weights and "
            "gradients, loaded straight into its shards. auto shards when the whole model does not fit one process; "
            "the grad norm and verdicts are the same either way. streamed: the saved ranks split over nproc "
            "processes (default 1), one decoder layer at a time read from the checkpoint (full fidelity on one "
            "device); auto streams only when "
            "no whole or sharded layout fits at full fidelity.",
            kind="choice",
            choices=Shard,
        ),
    )


@dataclass(frozen=True, kw_only=True)
class ReplayRequest:
    """What to replay, where and how, and where it is recorded. Build it with `replay_request`, which validates it."""

    what: What
    where: Where = field(default_factory=Where)
    how: How = field(default_factory=How)
    # recorded where
    workspace: Path | None = None  # None: nothing is written
    job: str | None = field(
        default=None,
        metadata=declare(
            summary="Job whose task logs it; default: the snapshot's.",
            help="The job whose task file logs the attempt, a plain name such as `axrl-v002-052915-math-moe-r3`. "
            "Default: the snapshot's `job_name`.",
            cli=False,
        ),
    )
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

    verb = _member(Verb, what.verb, "verb", None)
    what, where, how = _checked(what), _checked(where or Where()), _checked(how or How())
    backend, device, shard, method = where.backend, how.device, how.shard, what.method
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
    _check_streamed(shard, verb, how.nproc, launched or bool(targets) or slurm is not None)
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
    """The user's verdict threshold (its value checked by its declaration): for replays and sweeps of the local
    torch engine."""
    if value is None:
        return
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


def _check_streamed(shard: Shard, verb: Verb, nproc: int | None, launched: bool) -> None:
    """A streamed replay runs on this machine's processes (the saved ranks split over `nproc`, the engine bounds it
    by the saved world size); attribution is not streamed."""
    if shard != Shard.STREAMED:
        return
    if verb == Verb.ATTRIBUTE:
        raise ConfigError(
            "`shard` streamed: attribution is not computed streamed (its per-sample passes need the whole graph); "
            "use `shard` on or off",
            "shard",
        )
    if nproc is not None and nproc < 1:
        raise ConfigError(f"`nproc`: a streamed replay runs on 1 or more processes, not {nproc}", "nproc")
    if launched:
        raise ConfigError("`shard` streamed runs in one process on one machine, not launched over nodes", "shard")


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
