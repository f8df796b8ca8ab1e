"""The arguments many tools take: each has a one-line description in the tools' schemas and a whole explanation in
`GUIDE`, which the resource `axrl://arguments` serves (a client reads the schemas on every turn, the guide when it
needs it). Those that set a request field come from its declaration (`experiment.request.request_fields`): summary,
help and bounds are said there once; the Python type written here is checked against it by the tests. A declared
field a replay tool does not list itself becomes its parameter from the declaration alone (`with_declared_arguments`:
type, bounds, summary, default), so a new replay option reaches the MCP tools with no code here."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import Field

from axrl_spike_replay.experiment.request.request_fields import Declared, declared_fields
from axrl_spike_replay.investigation.request import How, ReplayRequest, What, Where
from axrl_spike_replay.vocabulary import Verb

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


_Tool = TypeVar("_Tool", bound=Callable[..., Any])
_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool}


def declared_annotation(declaration: Declared, default: Any) -> Any:
    """The parameter type a declaration gives a tool: its kind (a choice as the literal values), None allowed where
    the field's default is None, with the declaration's summary and bounds."""
    if declaration.choices is not None:
        kind: Any = cast(Any, Literal)[tuple(declaration.choices.values())]
    else:
        kind = _TYPES[declaration.kind]
    if default is None:
        kind = kind | None
    return Annotated[kind, schema_field(declaration)]


def with_declared_arguments(verb: Verb, parts: tuple[type, ...] = (What, Where, How)) -> Callable[[_Tool], _Tool]:
    """A replay tool that also takes, as keyword parameters after its own, every field of the request's `parts`
    declared for `verb` (and for MCP) with a simple kind that it does not list itself; it receives them in its
    `**declared`."""

    def add(tool: _Tool) -> _Tool:
        signature = inspect.signature(tool, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in own}
        generated = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_default(d, default),
                              annotation=declared_annotation(d, default))
            for name, d, default in declared_fields(*parts)
            if d.mcp and verb in d.verbs and d.kind != "any" and name not in taken
        ]  # fmt: skip
        tool.__signature__ = signature.replace(parameters=[*own, *generated])
        return tool

    return add


def part_values(part: type, declared: Mapping[str, Any]) -> dict[str, Any]:
    """The generated arguments (`with_declared_arguments`) that set fields of `part` (What, Where or How)."""
    names = {f.name for f in fields(part)}
    return {name: value for name, value in declared.items() if name in names}


def _default(declaration: Declared, default: Any) -> Any:
    return str(default) if declaration.kind == "choice" and default is not None else default


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
