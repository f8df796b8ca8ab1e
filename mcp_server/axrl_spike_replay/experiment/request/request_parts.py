"""The replay request's parts, each field declared once: `What` to replay, `Where` it runs and `How` it computes,
and `ReplayRequest`, the three with where the run is recorded. The engine (`replay.engine`) takes the request as it
is; `investigation.request.replay_request` builds it and checks every field and combination before anything runs.
Each field carries its declaration (`request_fields.declare`: summary, help, bounds or choices, the verbs that take
it), from which the CLI's options, the MCP tools' parameter schemas and the value checks come.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.experiment.request.request_fields import ALL_BACKENDS, declare
from axrl_spike_replay.vocabulary import Backend, Device, Method, Shard, Verb

RUN_TIMEOUT_S = 1800.0  # a run's limit in seconds where `timeout_s` is not given (and its collectives')

LOCAL = "local"  # the target that means this machine

MAX_REPEAT = 100  # a determinism check needs a handful of recomputations; each one is a whole replay
HERE_BACKENDS = (Backend.TORCH, Backend.MEGATRON)  # backends the built-in engine runs in this process tree


_REPLAY_SWEEP = (Verb.REPLAY, Verb.SWEEP)
_ENGINE_AND_COMMAND = (Backend.TORCH, Backend.COMMAND)


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
            backends=ALL_BACKENDS,
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
            backends=_ENGINE_AND_COMMAND,  # Megatron-core's route replays the baseline
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
            backends=ALL_BACKENDS,
        ),
    )
    top_params: int = field(
        default=10,
        metadata=declare(
            summary="Params listed.",  # the help is in axrl://arguments
            help="How many parameters the result lists by gradient norm, the largest first: more show how far the "
            "spike spreads over the layers and experts.",
            kind="int",
            ge=1,
            verbs=(Verb.REPLAY,),
            metavar="N",
            backends=ALL_BACKENDS,
        ),
    )
    configs: tuple[Mapping[str, Any], ...] = field(
        default=(),
        metadata=declare(  # sweep: the configs to compare, normalised and distinct
            summary="Configs to compare, each {NAME: VALUE} (names as for replay); the baseline always runs.",
            help="Mitigation configs to compare, each `{NAME: VALUE, ...}`, distinct and none empty (the baseline "
            "always runs). Loss-level configs share one forward pass. A config the checks refuse (a value out of "
            "range, a rank or layer the snapshot lacks) does not stop the others: it is reported in its place with "
            "verdict failed and the reason, and logged under Failed attempts.",
            verbs=(Verb.SWEEP,),
            cli=False,  # --mitigation-set FILE or --mitigation per config
            backends=_ENGINE_AND_COMMAND,
        ),
    )
    # a sweep's configs its checks refused (their place among the configs as given, the config as given, why): the
    # others run, these are reported beside them; `replay_request` fills it, no face declares it
    refused: tuple[tuple[int, Mapping[str, Any], str], ...] = ()
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
            backends=HERE_BACKENDS,  # the command backend is judged by the detector's threshold
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
            help="Stop the run after this many seconds. On a node: its whole process group (or its Slurm job) is "
            "killed, partial logs kept. Here: its processes are stopped at their next config, layer or micro-batch; "
            "the run dir keeps its log and a failed result naming the limit, and no spill dir is left. Unset here: "
            f"a streamed replay stops after {RUN_TIMEOUT_S:g} s, and a replay's processes wait that long at most on "
            "each other.",
            kind="float",
            gt=0,
            must="a positive number of seconds",
            backends=ALL_BACKENDS,  # here (the engine, Megatron-core's route, the command) and on a node
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
            backends=HERE_BACKENDS,  # the trainer's own command starts its processes as it does
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
        return where.backend in HERE_BACKENDS and where.target == LOCAL and not where.targets and where.slurm is None
