"""The arguments many tools take, declared once: each has a one-line description in the tools' schemas and a whole
explanation in `GUIDE`, which the resource `axrl://arguments` serves (a client reads the schemas on every turn, the
guide when it needs it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

ARGUMENTS_URI = "axrl://arguments"
MITIGATIONS_URI = "axrl://mitigations"

GUIDE: dict[str, str] = {
    "snapshot": "A snapshot directory `.../checkpoints/spike_snapshots[-active]/iter_<N>`, absolute or relative to "
    "the workspace. Prefer the preserved copy under `spike_snapshots-active` (preserve_snapshots makes it): the "
    "trainer's rotation deletes the original.",
    "workspace": "The workspace root, holding agent-task/ (task files), tmp/ (run dirs, copies of logs) and "
    "spike-mitigation-methods/ (method files). Default: the server's workspace (`mcp --workspace`, else its working "
    "directory); a relative path is taken from there.",
    "job": "The job whose task file logs the attempt, a plain name such as `axrl-v002-052915-math-moe-r3`. Default: "
    "the snapshot's `job_name`.",
    "mitigations": "One mitigation config `{NAME: VALUE}`; empty is the baseline replay. The names, their values and "
    "what each changes: resource axrl://mitigations. A loss setting scoped to saved ranks, `{'aux_loss_coef': "
    "'10.24@1'}`, is a hypothesis about what those ranks computed: it is judged against the recording as the "
    "baseline is (grad norm and every rank's loss), and its `finding` says 'reproduced under ...' or not.",
    "configs": "Mitigation configs to compare, each `{NAME: VALUE, ...}`, distinct and none empty (the baseline "
    "always runs). Loss-level configs share one forward pass.",
    "nproc": "Replay processes. Default: the saved world size, which is full fidelity. Fewer gives a reduced-fidelity "
    "diagnostic, labelled as such everywhere it is reported.",
    "device": "Where the replay processes compute: cpu, or cuda (one GPU per process).",
    "shard": "Shard the policy over the replay's processes with FSDP2: each holds 1/N of the weights and gradients, "
    "loaded straight into its shards. auto shards when the whole model does not fit one process; the grad norm and "
    "verdicts are the same either way.",
    "parallel_configs": "Run a sweep's configs on this many pools of `nproc` processes side by side, each also "
    "computing the baseline; the results are those of one pool. Default: 1 on CPU; on CUDA as many pools as the "
    "GPUs hold. Built-in torch engine, run here only.",
    "target": "The GPU node to run on, as typed: `ssh -p 26461 root@10.100.4.23`, `user@host:port`, "
    "`ssh://user@host:port`, a ~/.ssh/config alias, or a target name from the workspace's spike-replay.yaml. The "
    "snapshot must be at the same path there (shared storage). Omit it to run here.",
    "targets": "Several nodes to run one replay on (each as for `target`): one torchrun agent on each, one c10d "
    "rendezvous on the first, results gathered on rank 0; `nproc` spreads evenly over them. Every node must see the "
    "snapshot at the same path. A `multinode:` entry of spike-replay.yaml named as `target` does the same.",
    "slurm": "Run as a Slurm job (sbatch, then srun -> torchrun on each allocated node), submitted from `target` as "
    "the login node (omit `target`: this machine). Settings: partition, account, time (HH:MM:SS), nodes, "
    "gpus_per_node, nproc_per_node, cpus_per_task, job_dir, sbatch_args, schedule_timeout_s; they override those of "
    "the `slurm:` entry `target` names. Cancelling the call, and `timeout_s`, scancel the job.",
    "backend": "torch: the built-in engine. megatron: Megatron-core's own GPTModel recomputes the baseline of a "
    "Megatron snapshot here (replay only, no mitigations; needs the megatron extra), the cross-check of torch. "
    "command: the node's own replay command from spike-replay.yaml, for trainers the engine cannot rebuild (e.g. "
    "TP/PP/EP > 1); mitigations run as the trainer's own overrides, mapped in spike-replay.yaml's "
    "command_backend.mitigations (an unmapped one is refused by name), optionally with `patch`/`patches`.",
    "patch": "A unified diff (file path) applied in a temporary git worktree of the node's training checkout for this "
    "run only (backend command); the checkout itself is never modified. The patched code runs on the node as its "
    "SSH user: it can do whatever that user can.",
    "patches": "Several unified diffs (file paths) applied in this order in one temporary git worktree (backend "
    "command), after `patch` when both are given; one that does not apply fails the run by name and nothing runs.",
    "remote_python": "The node's Python interpreter. Default: spike-replay.yaml's, else python3.",
    "accept_new_host_key": "Record the host key of a node not yet in known_hosts (as OpenSSH's accept-new does), "
    "only after the user confirmed its fingerprint. A changed key is always refused.",
    "timeout_s": "Kill the run, its whole process group (or its Slurm job), after this many seconds.",
    "clear_threshold": "The spike ratio (grad norm / median) verdicts use: a mitigation clears the spike under it, "
    "the baseline is a spike at or above it. Default: the snapshot's detector threshold.",
}


def guide_text() -> str:
    """The resource `axrl://arguments`: every shared argument, whole."""
    lines = ["Arguments that several tools take (the tools' schemas carry one line each):", ""]
    lines += [f"- {name}: {text}" for name, text in GUIDE.items()]
    return "\n".join(lines) + "\n"


SnapshotArg = Annotated[
    str,
    Field(description="Snapshot dir iter_<N> (the preserved copy).", min_length=1),
]
WorkspaceArg = Annotated[str | None, Field()]  # the server's instructions say it once, for every tool
JobOptArg = Annotated[str | None, Field(description="Job whose task logs it; default: the snapshot's.")]
MitigationsArg = Annotated[
    dict[str, Any],
    Field(
        description="One config {NAME: VALUE}; {} = baseline; 'VALUE@RANKS' on a loss setting = a hypothesis. "
        f"Names and values: {MITIGATIONS_URI}.",
    ),
]
ConfigsArg = Annotated[
    list[dict[str, Any]],
    Field(
        description="Configs to compare, each {NAME: VALUE} (names as for replay); the baseline always runs.",
        min_length=1,
    ),
]
NprocArg = Annotated[int | None, Field(description="Processes; default: the saved world size.", ge=1)]
DeviceArg = Annotated[Literal["cpu", "cuda"], Field()]
ShardArg = Annotated[Literal["auto", "on", "off"], Field(description="Shard the model over the processes (FSDP2).")]
ParallelConfigsArg = Annotated[
    int | None,  # no bounds here: the request builder checks it and names `parallel_configs`, as for the CLI
    Field(description="Pools running the configs side by side."),
]
TargetArg = Annotated[str | None, Field(description="Node to run on over SSH, as typed; omit: here.")]
TargetsArg = Annotated[list[str], Field(description="Nodes for one multi-node job.")]
SlurmArg = Annotated[dict[str, Any] | None, Field(description="Run as a Slurm job: {partition, time, nodes, ...}.")]
BackendArg = Annotated[
    Literal["torch", "megatron", "command"],
    Field(description="Engine: built-in, Megatron-core, or the node's command."),
]
PatchArg = Annotated[str | None, Field(description="A diff for the command backend.")]
PatchesArg = Annotated[list[str], Field(description="Diffs for the command backend, in order.")]
RemotePythonArg = Annotated[str | None, Field(description="The node's Python.")]
AcceptNewKeyArg = Annotated[bool, Field(description="Record a new host key the user confirmed.")]
TimeoutArg = Annotated[float | None, Field(description="Stop the run after this many seconds.", gt=0)]
ClearThresholdArg = Annotated[
    float | None, Field(description="Spike ratio verdicts use; default: the detector's.", gt=0)
]
