"""An agent (or a prompt injection) passes wrong arguments to the MCP tools: every call answers with a
result or a tool error that carries a bounded message; the server never crashes or writes outside."""

from __future__ import annotations

import anyio
from hostile_helpers import MAX_MESSAGE, scene
from hostile_strategies import hostile_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client

from axrl_spike_replay.server import create_server

# Tools that reach other machines get no target here: hostile text must not become network traffic.
TOOLS = {
    "resolve_job": ["job", "roots"],
    "list_snapshots": ["output_dir"],
    "preserve_snapshots": ["output_dir", "iteration"],
    "release_preserved": ["output_dir", "iteration"],
    "inspect_snapshot": ["snapshot"],
    "prepare_replay_dir": ["snapshot", "dest"],
    "copy_and_scan_logs": ["logs", "job", "window", "threshold", "warmup"],
    "analyze_batch": ["snapshot", "top"],
    "top_param_grads": ["snapshot", "top"],
    "replay": ["snapshot", "mitigations", "nproc", "repeat", "job"],
    "sweep": ["snapshot", "configs", "job"],
    "attribute_spike": ["snapshot", "top", "mitigations", "method"],
    "task_open": ["job", "snapshot"],
    "task_note": ["job", "section", "text"],
    "task_show": ["job"],
    "method_add": ["job", "attempt", "name", "rationale"],
    "write_report": ["job"],
    "checkpoint_interval": ["checkpoint_cost_s", "mtbf_steps", "step_time_s"],
}
PATHISH = st.sampled_from(["", ".", "..", "/", "/etc/passwd", "../../outside", "no-such-dir", "a\x00b", "~root"])


def _argument(world_paths: list[str]) -> st.SearchStrategy[object]:
    return st.one_of(hostile_values, PATHISH, st.sampled_from(world_paths))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_arguments_get_a_result_or_a_clear_tool_error(data):
    with scene() as world:
        outside_paths = [str(world.outside), str(world.outside / "precious.txt"), str(world.root / "outputs")]
        tool = data.draw(st.sampled_from(sorted(TOOLS)), label="tool")
        names = data.draw(st.lists(st.sampled_from(TOOLS[tool]), unique=True), label="names")
        arguments = {name: data.draw(_argument(outside_paths), label=name) for name in names}
        before = world.outside_digest()

        async def main():
            async with Client(create_server(world.workspace)) as client:
                with anyio.fail_after(120):
                    return await client.call_tool(tool, arguments)

        result = anyio.run(main)
        if result.is_error:
            text = "".join(getattr(block, "text", "") for block in result.content)
            assert text.strip(), f"{tool}: a tool error without a message"
            assert "Error executing tool" not in text or ":" in text.split("Error executing tool", 1)[1], text
            assert len(text) <= MAX_MESSAGE, f"{tool}: {len(text)}-character error"
            assert "Traceback" not in text
        assert world.outside_digest() == before
