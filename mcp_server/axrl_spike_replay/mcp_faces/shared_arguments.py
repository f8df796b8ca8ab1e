"""The arguments many tools take: each has a one-line description in the tools' schemas and a whole explanation in
`GUIDE`, which the resource `axrl://arguments` serves (a client reads the schemas on every turn, the guide when it
needs it). Those that set a request field come from its declaration (`experiment.request.request_fields`): summary,
help and bounds are said there once; the Python type written here is checked against it by the tests."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from axrl_spike_replay.experiment.request.request_fields import Declared, declared_fields
from axrl_spike_replay.investigation.request import How, ReplayRequest, What, Where

ARGUMENTS_URI = "axrl://arguments"
MITIGATIONS_URI = "axrl://mitigations"

# every request field the MCP tools take, as the request declares it (`experiment.request.request_fields`)
DECLARED: dict[str, Declared] = {name: d for name, d, _ in declared_fields(What, Where, How, ReplayRequest) if d.mcp}
# arguments of the tools that are not request fields
_FACE_GUIDE = {
    "workspace": "The workspace root, holding agent-task/ (task files), tmp/ (run dirs, copies of logs) and "
    "spike-mitigation-methods/ (method files). Default: the server's workspace (`mcp --workspace`, else its working "
    "directory); a relative path is taken from there.",
    "patch": "One unified diff (file path), applied before `patches` (see there).",
    "detail": "diagnose_spike: also return `step`, the model evidence behind the causes (every rank's stored signal "
    "against the replay, pair by pair, and the gradient by loss term and rank; tens of KB). Default false: the causes, "
    "their evidence, `reading` (what those figures single out) and the rest are returned whole, `step` is null.",
}
GUIDE: dict[str, str] = {"snapshot": DECLARED["snapshot"].help, **_FACE_GUIDE}
GUIDE |= {name: d.help for name, d in DECLARED.items()}


def declared_field(name: str, **schema: Any) -> Any:
    """The pydantic `Field` of a tool parameter that sets the request field `name` (`schema`: what only the schema
    says, e.g. `min_length`)."""
    return schema_field(DECLARED[name], **schema)


def schema_field(declaration: Declared, **schema: Any) -> Any:
    """The pydantic `Field` a declaration gives a tool parameter: its one-line summary and, where the declaration
    puts them in the schema, its bounds."""
    if declaration.summary:
        schema["description"] = declaration.summary
    if declaration.schema_bounds:
        schema |= {key: value for key in ("ge", "le", "gt") if (value := getattr(declaration, key)) is not None}
    return Field(**schema)


def guide_text() -> str:
    """The resource `axrl://arguments`: every shared argument, whole."""
    lines = ["Arguments that several tools take (the tools' schemas carry one line each):", ""]
    lines += [f"- {name}: {text}" for name, text in GUIDE.items()]
    return "\n".join(lines) + "\n"


SnapshotArg = Annotated[str, declared_field("snapshot", min_length=1)]
WorkspaceArg = Annotated[str | None, Field()]  # the server's instructions say it once, for every tool
JobOptArg = Annotated[str | None, declared_field("job")]
MitigationsArg = Annotated[dict[str, Any], declared_field("mitigations")]
ConfigsArg = Annotated[list[dict[str, Any]], declared_field("configs", min_length=1)]
RepeatArg = Annotated[int, declared_field("repeat")]
ClearThresholdArg = Annotated[float | None, declared_field("clear_threshold")]
SamplesTopArg = Annotated[int, declared_field("top")]
MethodArg = Annotated[Literal["jvp", "per_sample_backward"], declared_field("method")]
TargetArg = Annotated[str | None, declared_field("target")]
TargetsArg = Annotated[list[str], declared_field("targets")]
SlurmArg = Annotated[dict[str, Any] | None, declared_field("slurm")]
BackendArg = Annotated[Literal["torch", "megatron", "command"], declared_field("backend")]
PatchArg = Annotated[str | None, Field(description="A diff for the command backend.")]
PatchesArg = Annotated[list[str], declared_field("patches")]
RemotePythonArg = Annotated[str | None, declared_field("remote_python")]
AcceptNewKeyArg = Annotated[bool, declared_field("accept_new_host_key")]
TimeoutArg = Annotated[float | None, declared_field("timeout_s")]
NprocArg = Annotated[int | None, declared_field("nproc")]
DeviceArg = Annotated[Literal["cpu", "cuda"], declared_field("device")]
ParallelConfigsArg = Annotated[int | None, declared_field("parallel_configs")]
ShardArg = Annotated[Literal["auto", "on", "off", "streamed"], declared_field("shard")]
