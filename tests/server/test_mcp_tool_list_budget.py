"""What a client's model reads on every turn: the whole `tools/list` answer of a real stdio session stays within its
budget, and nothing is lost by it: every tool is whole in its resource, every argument and result field is still
there, and a lean output schema accepts what the full one does while still checking what a client branches on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from server_helpers import server_command, with_client

from axrl_spike_replay.mcp_faces.lean_tools import lean_input_schema, lean_output_schema, summary
from axrl_spike_replay.mcp_faces.shared_arguments import GUIDE
from axrl_spike_replay.server import INSTRUCTIONS, create_server

WHOLE_BUDGET = 40_000  # characters of the tools/list response, output schemas included (about 10k tokens)
READ_BUDGET = 20_000  # names, titles, descriptions, input schemas and annotations


def _rpc(id_: int | None, method: str, params: dict[str, Any]) -> str:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    if id_ is not None:
        message["id"] = id_
    return json.dumps(message) + "\n"


def _tools_list_line(workspace: Path) -> str:
    """The raw line a stdio server answers `tools/list` with, after a real initialize handshake."""
    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "budget", "version": "1"}}
    lines = _rpc(1, "initialize", hello) + _rpc(None, "notifications/initialized", {}) + _rpc(2, "tools/list", {})
    cmd = [*server_command(), "mcp", "--workspace", str(workspace)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as server:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(lines)
        server.stdin.flush()
        try:
            for line in server.stdout:
                if json.loads(line).get("id") == 2:
                    return line.rstrip("\n")
        finally:
            server.stdin.close()
            server.wait(timeout=60)
    raise AssertionError("the server never answered tools/list")


def test_the_tool_list_of_a_real_stdio_session_fits_its_budget(workspace: Path) -> None:
    line = _tools_list_line(workspace)
    tools = json.loads(line)["result"]["tools"]
    read = json.dumps([{k: v for k, v in t.items() if k != "outputSchema"} for t in tools], separators=(",", ":"))
    assert len(tools) == 22
    assert len(line) <= WHOLE_BUDGET, f"tools/list is {len(line)} characters"
    assert len(read) <= READ_BUDGET, f"names, descriptions and input schemas are {len(read)} characters"
    assert "axrl://tool/{name}" in INSTRUCTIONS and "axrl://arguments" in INSTRUCTIONS  # where the rest is


def test_every_tool_is_whole_in_its_resource_with_every_argument_and_result_field(workspace: Path) -> None:
    server = create_server(workspace)

    async def read_all(client: Any) -> tuple[list[Any], dict[str, dict[str, Any]]]:
        listed = (await client.list_tools()).tools
        whole = {}
        for tool in listed:
            resource = await client.read_resource(f"axrl://tool/{tool.name}")
            whole[tool.name] = json.loads(resource.contents[0].text)
        return listed, whole

    listed, whole = with_client(server, read_all)
    for tool in listed:
        full = whole[tool.name]
        assert summary(full["description"]) == tool.description, tool.name  # the list's is its first paragraph
        args = full["input_schema"]["properties"]
        assert set(args) == set(tool.input_schema["properties"]), tool.name  # no argument lost
        for arg, schema in args.items():  # each explained somewhere: its schema, its choices, or the guide
            assert schema.get("description") or schema.get("enum") or arg in GUIDE, f"{tool.name}.{arg}"
        if tool.output_schema is not None:
            full_fields = _fields(full["output_schema"])
            assert set(tool.output_schema["properties"]) == set(full_fields), tool.name  # no result field lost
    arguments = with_client(server, lambda client: client.read_resource("axrl://arguments"))
    text = arguments.contents[0].text
    assert all(f"- {name}: " in text for name in ("target", "slurm", "backend", "shard", "nproc", "workspace"))


def _fields(schema: dict[str, Any]) -> dict[str, Any]:
    root = schema
    while "$ref" in root:
        root = schema["$defs"][root["$ref"].rsplit("/", 1)[-1]]
    return root.get("properties", {})


def test_an_unknown_tool_has_no_resource(workspace: Path) -> None:
    from mcp.shared.exceptions import MCPError

    async def read(client: Any) -> str:
        try:
            await client.read_resource("axrl://tool/rm_rf")
        except MCPError as exc:
            return str(exc)
        return "read"

    assert "no tool 'rm_rf'; tools/list names them" in with_client(create_server(workspace), read)


FULL = {
    "$defs": {
        "Row": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
        "Verdict": {"type": "string", "enum": ["reproduced", "not_reproduced"]},
    },
    "type": "object",
    "properties": {
        "verdict": {"$ref": "#/$defs/Verdict"},
        "grad_norm": {"anyOf": [{"type": "number"}, {"type": "null"}], "title": "Grad Norm"},
        "rows": {"type": "array", "items": {"$ref": "#/$defs/Row"}},
        "finding": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        "anything": {},
    },
    "required": ["verdict", "grad_norm", "rows"],
}


@pytest.mark.parametrize(
    "instance",
    [
        {"verdict": "reproduced", "grad_norm": 3.5, "rows": [{"x": 1}], "finding": None, "anything": [1]},
        {"verdict": "not_reproduced", "grad_norm": None, "rows": [], "extra": {"kept": True}},
    ],
)
def test_a_lean_output_schema_accepts_what_the_full_one_accepts(instance: dict[str, Any]) -> None:
    jsonschema.validate(instance, FULL)
    jsonschema.validate(instance, lean_output_schema(FULL))


def test_a_non_finite_figure_sent_as_null_meets_the_lean_schema() -> None:
    """A NaN grad norm goes out as null (JSON has no NaN): a `float` field admits it, or a client refuses the result."""
    schema = {"type": "object", "properties": {"grad_norm": {"type": "number"}}, "required": ["grad_norm"]}
    jsonschema.validate({"grad_norm": None}, lean_output_schema(schema))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"grad_norm": "nan"}, lean_output_schema(schema))


@pytest.mark.parametrize(
    "instance",
    [
        {"verdict": "cleared", "grad_norm": 1.0, "rows": []},  # a verdict the tool never gives
        {"verdict": "reproduced", "grad_norm": "big", "rows": []},  # a wrong top-level type
        {"grad_norm": 1.0, "rows": []},  # a required field missing
    ],
)
def test_a_lean_output_schema_still_checks_what_a_client_branches_on(instance: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, lean_output_schema(FULL))


def test_a_lean_input_schema_keeps_every_constraint() -> None:
    full = {
        "type": "object",
        "properties": {
            "nproc": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}], "default": None, "title": "N"},
            "title": {"type": "string", "title": "Title", "minLength": 1},  # an argument named `title` stays
            "shard": {"enum": ["auto", "on", "off"], "type": "string", "default": "auto", "title": "Shard"},
            "loose": {"type": "object", "additionalProperties": True},  # what an object allows anyway: left out
            "strict": {"type": "object", "additionalProperties": False},  # a constraint: kept
        },
        "required": ["title"],
    }
    lean = lean_input_schema(full)
    assert lean["properties"]["nproc"] == {"type": ["integer", "null"], "minimum": 1}
    assert lean["properties"]["title"] == {"type": "string", "minLength": 1}
    assert lean["properties"]["shard"]["default"] == "auto"
    assert lean["properties"]["loose"] == {"type": "object"}
    assert lean["properties"]["strict"] == {"type": "object", "additionalProperties": False}
    for good in ({"title": "t"}, {"title": "t", "nproc": None, "shard": "on"}, {"title": "t", "nproc": 2}):
        jsonschema.validate(good, full)
        jsonschema.validate(good, lean)
    for good in ({"title": "t", "loose": {"any": 1}}, {"title": "t", "strict": {}}):
        jsonschema.validate(good, full)
        jsonschema.validate(good, lean)
    bad_ones = ({"title": ""}, {"title": "t", "nproc": 0}, {"title": "t", "shard": "maybe"}, {"nproc": 2})
    for bad in (*bad_ones, {"title": "t", "strict": {"any": 1}}):
        for schema in (full, lean):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)
