"""diagnose_spike through MCP: the same diagnosis as the library, as structured content."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mcp import Client
from mcp.types import CallToolResult, TextResourceContents
from server_helpers import call, error_text, ok, with_client

from axrl_spike_replay.diagnosis import FAMILIES
from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS
from axrl_spike_replay.server import create_server


def test_diagnose_spike_ranks_the_mismatch_first_with_ready_mitigations(captured_run, workspace: Path) -> None:
    doc = ok(call(workspace, "diagnose_spike", {"snapshot": str(captured_run.snapshot_dirs[0]), "model": "never"}))
    assert doc["causes"][0]["family"] == "engine_mismatch"
    assert doc["next_steps"][0]["mitigation"] == "mismatch_token_clip_max=2"
    assert doc["consistency"]["self_consistent"] is True and doc["consistency"]["agrees_with_log"] is True


def test_diagnose_spike_keeps_its_diagnosis_in_the_open_task(captured_run, workspace: Path) -> None:
    snapshot = str(captured_run.snapshot_dirs[0])
    ok(call(workspace, "task_open", {"job": "demo-moe-grpo", "snapshot": snapshot}))
    ok(call(workspace, "diagnose_spike", {"snapshot": snapshot, "model": "never"}))
    shown = ok(call(workspace, "task_show", {"job": "demo-moe-grpo"}))
    state = json.loads(Path(shown["state_file"]).read_text())
    assert len(state["diagnoses"]) == 2 and state["diagnoses"][1]["snapshot"] == state["snapshot"]
    task = Path(shown["task_file"]).read_text()
    assert "`task_note`" in task  # the task file names the MCP tools that edit it


def test_a_read_only_server_diagnoses_without_writing_into_the_open_task(captured_run, workspace: Path) -> None:
    snapshot = str(captured_run.snapshot_dirs[0])
    ok(call(workspace, "task_open", {"job": "demo-moe-grpo", "snapshot": snapshot}))
    state_file = Path(ok(call(workspace, "task_show", {"job": "demo-moe-grpo"}))["state_file"])
    before = state_file.read_bytes()
    read_only = create_server(workspace, read_only=True)
    result = with_client(
        read_only, lambda client: client.call_tool("diagnose_spike", {"snapshot": snapshot, "model": "never"})
    )
    assert ok(result)["causes"][0]["family"] == "engine_mismatch"
    assert state_file.read_bytes() == before  # a server that only reads wrote nothing


def test_a_read_only_server_runs_no_replay_for_the_model_evidence(captured_run, workspace: Path) -> None:
    """The model evidence replays the step (here, or on rank processes with `nproc`): a read-only server runs none."""
    snapshot = str(captured_run.snapshot_dirs[0])
    read_only = create_server(workspace, read_only=True)

    async def calls(client: Client) -> tuple[CallToolResult, list[CallToolResult]]:
        plain = await client.call_tool("diagnose_spike", {"snapshot": snapshot})  # auto: a small model
        refused = [
            await client.call_tool("diagnose_spike", {"snapshot": snapshot, **asked})
            for asked in ({"model": "always"}, {"model": "auto", "nproc": 2}, {"shard": "on"}, {"shard": "streamed"})
        ]
        return plain, refused

    plain, refused = with_client(read_only, calls)
    doc = ok(plain)
    assert doc["step"] is None and doc["attribution_top"] == [] and doc["routes"] is None
    assert doc["causes"][0]["family"] == "engine_mismatch"  # the static evidence still names it
    assert any("read-only" in line and "runs no replay" in line for line in doc["not_checked"])
    for result, named in zip(refused, ("`model` always", "`nproc` 2", "`shard` on", "`shard` streamed"), strict=True):
        text = error_text(result)
        assert named in text and "runs no replay" in text, text


def test_tool_texts_name_only_tools_that_exist(workspace: Path) -> None:
    tools = with_client(create_server(workspace), lambda client: client.list_tools()).tools
    names = {t.name for t in tools}
    verbs = r"\b([a-z]+_(?:samples|spike|snapshot|snapshots|batch|grads|logs|add|list|open|note|show))\b"
    params = {p for t in tools for p in (t.input_schema.get("properties") or {})}
    # the snapshot directory's name, the mitigations, the cause families
    not_tools = {"spike_snapshots", *MITIGATIONS, *FAMILIES}
    for tool in tools:
        texts = [tool.description or ""] + [
            str(p.get("description", "")) for p in (tool.input_schema.get("properties") or {}).values()
        ]
        for word in re.findall(verbs, " ".join(texts)):
            assert word in names | params | not_tools, f"{tool.name} names {word!r}, which is no tool"


def test_diagnose_spike_returns_the_per_rank_step_evidence_only_when_asked(captured_run, workspace: Path) -> None:
    """The model evidence's figures (`step`, most of the reply) come back with `detail` only; the lean reply meets
    the tool's whole output schema (as its resource gives it) and keeps the causes and `reading`."""
    import jsonschema

    snapshot = str(captured_run.snapshot_dirs[0])

    async def calls(client: Client) -> tuple[CallToolResult, CallToolResult, dict]:
        lean = await client.call_tool("diagnose_spike", {"snapshot": snapshot})  # auto: the model evidence runs
        full = await client.call_tool("diagnose_spike", {"snapshot": snapshot, "detail": True})
        whole = (await client.read_resource("axrl://tool/diagnose_spike")).contents[0]
        assert isinstance(whole, TextResourceContents)
        return lean, full, json.loads(whole.text)

    lean, full, tool = with_client(create_server(workspace), calls)
    lean_doc, full_doc = ok(lean), ok(full)
    assert lean_doc["step"] is None and full_doc["step"] is not None and full_doc["step"]["signals"]
    assert lean_doc["reading"] is not None and lean_doc["reading"] == full_doc["reading"]
    assert [(c["family"], c["strength"]) for c in lean_doc["causes"]] == [
        (c["family"], c["strength"]) for c in full_doc["causes"]
    ]
    size, whole = len(json.dumps(lean_doc)), len(json.dumps(full_doc))
    assert size < 0.6 * whole, (size, whole)
    for doc in (lean_doc, full_doc):
        jsonschema.validate(doc, tool["output_schema"])
