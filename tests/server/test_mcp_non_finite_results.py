"""A spike whose recorded grad norm is NaN (a non-finite reward reached the loss) is read over MCP like any other:
JSON has no NaN, so the figure goes out as null, and the listed output schema admits it (a client that checks
structured content against the schema once refused every reading tool's result)."""

from __future__ import annotations

import json
from pathlib import Path

from mcp import StdioServerParameters
from server_helpers import SpikeOutputs, server_command, with_client


def test_a_nan_grad_norm_comes_back_as_null_from_the_reading_tools(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    meta = spike_outputs.snapshot / "axrl_metadata.json"
    doc = json.loads(meta.read_text())
    doc["grad_norm"] = float("nan")
    meta.write_text(json.dumps(doc))  # Python's json writes NaN, as a trainer's json.dump does
    cmd = server_command()  # over stdio, as a client sees it: the wire's JSON
    params = StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])
    result = with_client(params, lambda c: c.call_tool("inspect_snapshot", {"snapshot": str(spike_outputs.snapshot)}))
    assert not result.is_error, result.content[0].text  # the client checked it against the listed schema
    assert result.structured_content is not None and result.structured_content["grad_norm"] is None
