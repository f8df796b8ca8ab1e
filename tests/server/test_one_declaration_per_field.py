"""A replay option is declared once, on the request's field, and both faces say what the declaration says: the CLI's
option (name, help, choices, type, default), the MCP tool's parameter (description, bounds, enum, default) and the
resource axrl://arguments; the request refuses a value out of bounds with the message its declaration makes."""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import pytest
from mcp.server.mcpserver import MCPServer
from mcp.types import TextResourceContents
from pydantic import TypeAdapter, ValidationError
from server_helpers import SpikeOutputs, call, ok, with_client

from axrl_spike_replay.cli import build_parser, main
from axrl_spike_replay.cli.request_options import add_request_options, option_help, request_values
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.request.request_fields import Declared, check_declared, declare, declared_fields
from axrl_spike_replay.investigation.request import How, ReplayRequest, What, Where, replay_request
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.mcp_faces.lean_tools import lean_tool
from axrl_spike_replay.mcp_faces.shared_arguments import part_values, schema_field, with_declared_arguments
from axrl_spike_replay.server import create_server
from axrl_spike_replay.vocabulary import Verb

DECLARED = list(declared_fields(What, Where, How, ReplayRequest))
TOOLS = {"replay": Verb.REPLAY, "sweep": Verb.SWEEP, "attribute_spike": Verb.ATTRIBUTE}
# tools outside the replay verbs that take some of the same fields, as a replay does
ALSO = {"plan_replay": ("nproc", "device", "shard"), "probe_node": ("remote_python", "accept_new_host_key")}
CLI_ALSO = {"plan": ("nproc", "device", "shard"), "node": ("remote_python", "known_hosts", "accept_new_host_key")}


def _subparser(verb: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[verb]


def _check_cli_option(parser: argparse.ArgumentParser, name: str, d: Declared, default: Any) -> None:
    actions = {a.dest: a for a in parser._actions}
    assert name in actions, f"{parser.prog}: no option sets `{name}`"
    action = actions[name]
    assert action.option_strings == [d.option(name)], name
    assert action.help == option_help(d, default), name
    if d.kind == "bool":
        assert isinstance(action, argparse._StoreTrueAction), name
        return
    assert action.default == (str(default) if d.kind == "choice" else default), name
    assert list(action.choices or ()) == list(d.choices.values() if d.choices else ()), name
    assert action.type is {"int": int, "float": float}.get(d.kind), name


@pytest.mark.parametrize("verb", [Verb.REPLAY, Verb.SWEEP, Verb.ATTRIBUTE])
def test_each_cli_verb_has_every_declared_option_as_declared(verb: Verb) -> None:
    parser = _subparser(str(verb))
    generated = [(n, d, default) for n, d, default in DECLARED if d.cli and verb in d.verbs]
    assert generated, verb
    for name, d, default in generated:
        _check_cli_option(parser, name, d, default)
    taken = {a.dest for a in parser._actions}  # and no verb has an option for a field it does not declare
    assert not {n for n, d, _ in DECLARED if d.cli and verb not in d.verbs} & taken, verb


@pytest.mark.parametrize(("verb", "names"), CLI_ALSO.items())
def test_plan_and_node_take_the_same_fields_as_declared(verb: str, names: tuple[str, ...]) -> None:
    found = {n: (d, default) for n, d, default in DECLARED}
    for name in names:
        _check_cli_option(_subparser(verb), name, *found[name])


def _listed(workspace: Path) -> dict[str, dict[str, Any]]:
    async def tools(client: Any) -> Any:
        return (await client.list_tools()).tools

    return {t.name: t.input_schema for t in with_client(create_server(workspace), tools)}


def _check_parameter(tool: str, schema: dict[str, Any], name: str, d: Declared, default: Any) -> None:
    where = f"{tool}.{name}"
    prop = schema["properties"].get(name)
    assert prop is not None, f"{where}: the tool does not take it"
    assert prop.get("description") == (d.summary or None), where
    bounds = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum"}
    for key, word in bounds.items():
        value = getattr(d, key) if d.schema_bounds else None
        assert prop.get(word) == value, f"{where}: {word}"
    if d.choices is not None:
        assert sorted(prop.get("enum") or ()) == sorted(d.choices.values()), where
    if default is MISSING:
        assert name in schema.get("required", []), where
    elif default is not None and d.kind != "any":  # the listed schema leaves null defaults out; a structured
        assert prop.get("default") == to_jsonable(default), where  # field's face maps "none given" itself


def test_each_mcp_tool_takes_every_declared_field_as_declared(workspace: Path) -> None:
    listed = _listed(workspace)
    for tool, verb in TOOLS.items():
        mine = [(n, d, default) for n, d, default in DECLARED if verb in d.verbs and d.mcp]
        for name, d, default in mine:
            _check_parameter(tool, listed[tool], name, d, default)
        others = {n for n, d, _ in DECLARED if verb not in d.verbs or not d.mcp}
        assert not others & set(listed[tool]["properties"]), tool  # nothing undeclared that names a field
    found = {n: (d, default) for n, d, default in DECLARED}
    for tool, names in ALSO.items():
        for name in names:
            _check_parameter(tool, listed[tool], name, *found[name])


def test_the_arguments_resource_is_each_declarations_whole_help(workspace: Path) -> None:
    content = with_client(create_server(workspace), lambda c: c.read_resource("axrl://arguments")).contents[0]
    assert isinstance(content, TextResourceContents)
    text = content.text
    for name, d, _ in DECLARED:
        assert (f"- {name}: {d.help}\n" in text) == d.mcp, name


BAD = {"int": [0, 2.5, True, "3"], "float": [0, -1.0, float("nan"), "1"]}


@pytest.mark.parametrize(
    ("part", "name", "d"),
    [(p, n, d) for p in (What, Where, How) for n, d, _ in declared_fields(p) if d.kind in ("int", "float", "choice")],
)
def test_the_request_refuses_what_the_declaration_refuses_naming_the_field(
    tmp_path: Path, part: type, name: str, d: Declared
) -> None:
    spike_snapshot = tmp_path / "iter_0000007"  # refused before anything is read
    values = BAD.get(d.kind, ["tpu", 3, None])
    if d.le is not None:
        values = [*values, d.le + 1]
    parts: dict[type, Any] = {What: What(spike_snapshot), Where: Where(), How: How()}
    for value in values:
        parts[part] = replace(parts[part], **{name: value})
        with pytest.raises(ConfigError) as info:
            replay_request(parts[What], parts[Where], parts[How])
        assert info.value.parameter == name
        said = f"one of {', '.join(d.choices.values())}" if d.choices else d.must_be()
        assert str(info.value).startswith(f"`{name}` must be {said}, got "), str(info.value)
        parts = {What: What(spike_snapshot), Where: Where(), How: How()}


def test_an_option_declared_on_the_request_reaches_the_cli_with_no_cli_code(
    spike_outputs: SpikeOutputs, workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`What.method` is declared for attribution: the CLI's `attribute --method` exists from that declaration alone
    and its value reaches the run."""
    argv = ["attribute", str(spike_outputs.snapshot), "--top", "2", "--workspace", str(workspace), "--json"]
    assert main([*argv, "--method", "per_sample_backward"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "per_sample_backward"
    with pytest.raises(SystemExit):
        main([*argv, "--method", "guess"])
    err = capsys.readouterr().err
    assert "--method: invalid choice: 'guess'" in err and "per_sample_backward" in err


def test_top_params_declared_once_lists_that_many_parameters_through_both_faces(
    spike_outputs: SpikeOutputs, workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`What.top_params` is one declaration and one use in the engine: `replay --top-params` and the MCP tool's
    `top_params` exist from it, and the result lists that many parameters, the largest grad norm first."""
    snapshot = str(spike_outputs.snapshot)
    listed = ok(call(workspace, "replay", {"snapshot": snapshot, "nproc": 1, "top_params": 12}))["top_params"]
    norms = [p["grad_norm"] for p in listed]
    assert len(listed) == 12 and norms == sorted(norms, reverse=True)
    argv = ["replay", snapshot, "--nproc", "1", "--workspace", str(workspace), "--json"]
    assert main([*argv, "--top-params", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["top_params"] == listed[:3]
    assert len(ok(call(workspace, "replay", {"snapshot": snapshot, "nproc": 1}))["top_params"]) == 10  # the default
    command = sorted(workspace.glob("tmp/spike-replay/*/*/command.txt"))
    assert sum("--top-params 3" in c.read_text() for c in command) == 1  # the CLI line that gives the same result


@dataclass(frozen=True, kw_only=True)
class _NewPart:
    """A part with one field declared the way a new replay option is: nothing else is written for either face."""

    warmup_steps: int | None = field(
        default=None,
        metadata=declare(
            summary="Steps to warm up first.",
            help="Warm-up steps before the replayed one.",
            kind="int",
            ge=0,
            le=8,
            verbs=(Verb.REPLAY,),
            metavar="N",
        ),
    )


def test_a_newly_declared_field_appears_in_both_faces_from_its_declaration_alone() -> None:
    parser = argparse.ArgumentParser(prog="replay")
    add_request_options(parser, Verb.REPLAY, _NewPart)
    assert request_values(parser.parse_args(["--warmup-steps", "3"]), _NewPart) == {"warmup_steps": 3}
    assert request_values(parser.parse_args([]), _NewPart) == {"warmup_steps": None}
    assert "Warm-up steps before the replayed one." in parser.format_help()
    attribute = argparse.ArgumentParser(prog="attribute")
    add_request_options(attribute, Verb.ATTRIBUTE, _NewPart)  # not a verb that takes it
    assert "--warmup-steps" not in attribute.format_help()

    ((name, declaration, _),) = declared_fields(_NewPart)
    adapter = TypeAdapter(Annotated[int | None, schema_field(declaration)])
    assert adapter.json_schema()["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 8}
    assert adapter.json_schema()["description"] == "Steps to warm up first."
    with pytest.raises(ValidationError):
        adapter.validate_python(9)
    with pytest.raises(ConfigError, match=r"^`warmup_steps` must be an integer from 0 to 8, got 9$"):
        check_declared(name, declaration, 9)


def test_a_newly_declared_field_becomes_a_replay_tools_parameter_from_its_declaration_alone() -> None:
    """The MCP face: a tool that does not list the field takes it as declared (type, bounds, summary, default) and
    receives it for the request's part that declares it; a tool of another verb does not take it."""
    got: list[dict[str, Any]] = []

    @with_declared_arguments(Verb.REPLAY, (What, Where, How, _NewPart))
    async def replay_like(snapshot: str, **declared: Any) -> str:
        got.append(part_values(_NewPart, declared))
        return snapshot

    @with_declared_arguments(Verb.ATTRIBUTE, (What, Where, How, _NewPart))
    async def attribute_like(snapshot: str, **declared: Any) -> str:
        return snapshot

    server = MCPServer("declared")
    server.add_tool(replay_like, name="replay_like")
    server.add_tool(attribute_like, name="attribute_like")

    async def body(client: Any) -> tuple[dict[str, Any], Any, Any]:
        tools = {t.name: lean_tool(t).input_schema for t in (await client.list_tools()).tools}  # as the server lists
        called = await client.call_tool("replay_like", {"snapshot": "s", "warmup_steps": 3})
        refused = await client.call_tool("replay_like", {"snapshot": "s", "warmup_steps": 9})
        return tools, called, refused

    tools, called, refused = with_client(server, body)
    ((name, declaration, default),) = declared_fields(_NewPart)
    _check_parameter("replay_like", tools["replay_like"], name, declaration, default)
    assert name not in tools["attribute_like"]["properties"]
    assert not called.is_error and got == [{"warmup_steps": 3}]
    assert refused.is_error and got == [{"warmup_steps": 3}]  # out of the declared bounds: refused by the schema
