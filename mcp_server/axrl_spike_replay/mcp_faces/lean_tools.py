"""What a client's model reads of each tool on every turn: a summary, a lean input schema and the output's top-level
fields. A client sends `tools/list` to its model with every request, so the list costs what it holds each turn. The
whole text and the full schemas stay one resource away (`axrl://tool/{name}`); nothing is dropped from the tools
themselves: every argument is accepted and every result field returned as before."""

from __future__ import annotations

import json
from typing import Any

from mcp.types import Tool, ToolAnnotations

TOOL_URI = "axrl://tool/{name}"
_JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# MCP's defaults for hints a tool leaves out (the spec's ToolAnnotations): a hint that says the default is not sent
HINT_DEFAULTS = {"read_only_hint": False, "destructive_hint": True, "idempotent_hint": False, "open_world_hint": True}
_MAX_ENUM = 12  # an enum this short is kept on a top-level output field: a client branches on it (a verdict)


def summary(description: str) -> str:
    """The description's first paragraph: what the tool is for and when to use it (the rest is in its resource)."""
    return " ".join(description.strip().split("\n\n", 1)[0].split())


def lean_tool(tool: Tool) -> Tool:
    """`tool` as listed: its summary (the server's instructions name the resource with the rest), titles and null
    defaults out of its input schema, and its output schema cut to top-level fields with their JSON types
    (structured content that met the full schema meets this one)."""
    update: dict[str, Any] = {
        "description": summary(tool.description or ""),
        "input_schema": lean_input_schema(tool.input_schema),
    }
    if tool.output_schema is not None:
        update["output_schema"] = lean_output_schema(tool.output_schema)
    if tool.annotations is not None:
        update["annotations"] = lean_annotations(tool.annotations)
    return tool.model_copy(update=update)


def lean_annotations(annotations: ToolAnnotations) -> ToolAnnotations:
    """The hints that differ from MCP's defaults (a client reads a missing hint as its default)."""
    kept = {k: v for k, v in annotations.model_dump(exclude_none=True).items() if HINT_DEFAULTS.get(k, not v) != v}
    return ToolAnnotations(**kept)


def hint(annotations: ToolAnnotations | None, name: str) -> bool:
    """A hint's value as a client reads it: as given, else MCP's default."""
    value = getattr(annotations, name, None) if annotations is not None else None
    return HINT_DEFAULTS[name] if value is None else bool(value)


def full_tool_doc(tool: Tool) -> str:
    """The whole tool as registered (description, input and output schemas), as JSON: the resource a lean entry
    points at."""
    doc = {
        "name": tool.name,
        "title": tool.title,
        "description": tool.description,
        "input_schema": tool.input_schema,
        "output_schema": tool.output_schema,
    }
    return json.dumps(doc, indent=1)


def lean_input_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The same constraints without pydantic's titles, null defaults and `additionalProperties: true` (what an object
    allows anyway); `X | None` is written `type: [X, null]`."""
    return _lean_node(schema)


def _lean_node(node: Any) -> Any:
    if isinstance(node, list):
        return [_lean_node(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key == "default" and value is None:
            continue
        if key == "additionalProperties" and value is True:  # JSON Schema's default: any property allowed
            continue
        if key in ("properties", "$defs") and isinstance(value, dict):
            out[key] = {name: _lean_node(sub) for name, sub in value.items()}
        else:
            out[key] = _lean_node(value)
    nullable = _nullable_simple(out.get("anyOf"))
    if nullable is not None:
        del out["anyOf"]
        out.update(nullable)
    return out


def _nullable_simple(options: Any) -> dict[str, Any] | None:
    """`anyOf: [{type: X, ...}, {type: null}]` as `{type: [X, null], ...}`, where X's schema is a plain type."""
    if not isinstance(options, list) or len(options) != 2 or {"type": "null"} not in options:
        return None
    (other,) = [o for o in options if o != {"type": "null"}]
    kind = other.get("type") if isinstance(other, dict) else None
    if not isinstance(kind, str) or "$ref" in other or "anyOf" in other:
        return None
    return {**other, "type": [kind, "null"]}


def lean_output_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The top-level fields of `schema` with their JSON types (a short enum kept), required fields as required, and
    every nested object or array open: what a client branches on, with the detail as documented JSON."""
    defs = schema.get("$defs", {})
    root = _resolved(schema, defs)
    fields = {name: _top_field(_resolved(sub, defs), defs) for name, sub in root.get("properties", {}).items()}
    out: dict[str, Any] = {"type": "object", "properties": fields}
    if root.get("required"):
        out["required"] = list(root["required"])
    return out


def _resolved(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while isinstance(node, dict) and "$ref" in node:
        node = defs.get(str(node["$ref"]).rsplit("/", 1)[-1], {})
    return node if isinstance(node, dict) else {}


def _top_field(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    kinds = _types(node, defs)
    if kinds is None:
        return {}  # any JSON value
    if "number" in kinds and "null" not in kinds:
        kinds = [*kinds, "null"]  # a non-finite figure (a NaN grad norm) is sent as null (`bridge.structured`)
    field: dict[str, Any] = {"type": kinds[0] if len(kinds) == 1 else kinds}
    enum = _enum(node, defs)
    if enum is not None:
        field["enum"] = enum
    return field


def _types(node: dict[str, Any], defs: dict[str, Any]) -> list[str] | None:
    """The JSON types `node` admits (None: any)."""
    node = _resolved(node, defs)
    if "anyOf" in node or "oneOf" in node:
        found: list[str] = []
        for option in node.get("anyOf", node.get("oneOf", [])):
            kinds = _types(option, defs)
            if kinds is None:
                return None
            found += [k for k in kinds if k not in found]
        return found
    kind = node.get("type")
    if isinstance(kind, str) and kind in _JSON_TYPES:
        return [kind]
    if isinstance(kind, list) and all(k in _JSON_TYPES for k in kind):
        return list(kind)
    if "enum" in node or "const" in node:
        values = node.get("enum", [node.get("const")])
        return sorted({_json_type(v) for v in values})
    return None


def _enum(node: dict[str, Any], defs: dict[str, Any]) -> list[Any] | None:
    """A short enum of `node` (with null where it admits null), else None."""
    node = _resolved(node, defs)
    options = node.get("anyOf", [node])
    values: list[Any] = []
    for option in options:
        option = _resolved(option, defs)
        if option.get("type") == "null":
            values.append(None)
        elif "enum" in option:
            values += option["enum"]
        elif "const" in option:
            values.append(option["const"])
        else:
            return None
    return values if 0 < len(values) <= _MAX_ENUM and any(v is not None for v in values) else None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "object"
