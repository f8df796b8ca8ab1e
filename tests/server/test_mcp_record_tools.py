"""The investigation record through MCP: open the task, note, show, write up a method, report; read it back as
resources. (Replay rows come from a real replay in the end-to-end test; here one is logged directly.)"""

from __future__ import annotations

import json
from pathlib import Path

from server_helpers import ITERATION, JOB, MEDIAN, RECORDED, SpikeOutputs, call, error_text, ok, with_client

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.server import create_server
from axrl_spike_replay.workspace.task_record.task_log import record_replay


def _log_replay(workspace: Path, snapshot: Path, name: str, grad_norm: float, verdict: str, **changes) -> str:
    doc = dict(
        snapshot=str(snapshot),
        backend="torch",
        target="local",
        fidelity="full",
        world_size_saved=2,
        world_size_used=2,
        mitigations={},
        grad_norm=grad_norm,
        recorded_grad_norm=RECORDED,
        rel_diff=abs(grad_norm - RECORDED) / RECORDED,
        median_norm=MEDIAN,
        spike_ratio=grad_norm / MEDIAN,
        verdict=verdict,
        threshold=5.0,
        job_name=JOB,
        role="actor",
        iteration=ITERATION,
    )
    result = ReplayResult(**{**doc, **changes})
    path = workspace / "tmp" / "spike-replay" / JOB / name / "replay_result.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(result.to_json()))
    return record_replay(workspace, JOB, result, path)


def test_task_open_note_show_and_the_task_resource(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    opened = ok(call(workspace, "task_open", {"job": JOB, "snapshot": str(spike_outputs.snapshot)}))
    assert opened["snapshot"] == str(spike_outputs.snapshot.resolve())
    assert Path(opened["task_file"]) == workspace / "agent-task" / "spike-replay" / f"{JOB}.md"

    noted = ok(call(workspace, "task_note", {"job": JOB, "section": "observations", "text": "rank 1 holds it"}))
    assert [n["text"] for n in noted["observations"]][-1] == "rank 1 holds it"  # after the diagnosis of the snapshot
    ok(call(workspace, "task_note", {"job": JOB, "section": "next-steps", "text": "sweep TIS"}))
    shown = ok(call(workspace, "task_show", {"job": JOB}))
    assert [n["text"] for n in shown["next_steps"]][-1] == "sweep TIS"

    async def read(client):
        listed = await client.list_resources()
        templates = await client.list_resource_templates()
        page = await client.read_resource(f"axrl://task/{JOB}")
        return listed, templates, page

    listed, templates, page = with_client(create_server(workspace), read)
    assert f"axrl://task/{JOB}" in {str(r.uri) for r in listed.resources}
    assert {t.uri_template for t in templates.resource_templates} >= {"axrl://task/{job}", "axrl://method/{slug}"}
    text = page.contents[0].text
    assert "rank 1 holds it" in text and "sweep TIS" in text


def test_a_bad_section_and_an_unknown_job_are_tool_errors(workspace: Path) -> None:
    text = error_text(call(workspace, "task_note", {"job": JOB, "section": "diary", "text": "x"}))
    assert "section" in text and "observations" in text
    text = error_text(call(workspace, "task_show", {"job": "never-opened"}))
    assert "never-opened" in text and "task open" in text


def test_method_add_list_and_report(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    ok(call(workspace, "task_open", {"job": JOB, "snapshot": str(spike_outputs.snapshot)}))
    _log_replay(workspace, spike_outputs.snapshot, "base", RECORDED, "reproduced")
    attempt = _log_replay(
        workspace,
        spike_outputs.snapshot,
        "tis",
        3.0,
        "cleared",
        mitigations={"mismatch_token_clip_max": 2.0},
        baseline_grad_norm=RECORDED,
        change_vs_baseline=3.0 / RECORDED - 1,
        config_id="mismatch_token_clip_max=2",
    )
    text = error_text(call(workspace, "method_add", {"job": JOB, "attempt": "E1", "name": "base", "rationale": "x"}))
    assert "E1" in text

    added = ok(
        call(
            workspace,
            "method_add",
            {"job": JOB, "attempt": attempt, "name": "tis-clip-2", "rationale": "clips the mismatched tokens"},
        )
    )
    assert added["status"] == "proven" and Path(added["path"]).is_file()
    listed = ok(call(workspace, "method_list", {}))
    assert [m["slug"] for m in listed["methods"] if m["source"] == "workspace"] == ["tis-clip-2"]
    assert any(m["source"] == "shipped" for m in listed["methods"])  # the shipped library is listed beside it
    duplicate = error_text(
        call(workspace, "method_add", {"job": JOB, "attempt": attempt, "name": "again", "rationale": "same"})
    )
    assert "tis-clip-2" in duplicate

    page = with_client(create_server(workspace), lambda client: client.read_resource("axrl://method/tis-clip-2"))
    assert "clips the mismatched tokens" in page.contents[0].text

    report = ok(call(workspace, "write_report", {"job": JOB}))
    assert Path(report["path"]) == workspace / "tmp" / "spike-replay" / JOB / "report.md"
    assert "tis-clip-2" in report["text"]


def test_write_report_releases_the_tasks_copy_but_the_last_copy_only_when_asked(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    import shutil

    from axrl_spike_replay.snapshot.preservation.preserve import preserve

    (copy,) = preserve(spike_outputs.output_dir, ITERATION).preserved
    ok(call(workspace, "task_open", {"job": JOB, "snapshot": copy.path}))
    shutil.rmtree(spike_outputs.snapshot)  # the rotating source is gone: the copy is the last one

    kept = ok(call(workspace, "write_report", {"job": JOB, "release": True}))
    assert kept["released"][0]["released"] is False and "release-last-copy" in kept["released"][0]["error"]
    assert Path(copy.path).is_dir()

    gone = ok(call(workspace, "write_report", {"job": JOB, "release": True, "release_last_copy": True}))
    assert gone["released"][0]["released"] is True and not Path(copy.path).exists()


def test_a_shipped_method_reads_through_the_method_resource_unless_the_workspace_has_its_own(
    workspace: Path,
) -> None:
    from axrl_spike_replay.workspace.method_files.methods import shipped_methods_dir

    shipped = shipped_methods_dir()
    assert shipped is not None
    slug = "advantage-clip-1"
    text = (shipped / f"{slug}.md").read_text(encoding="utf-8")

    async def read(client):
        listed = await client.list_resources()
        return listed, await client.read_resource(f"axrl://method/{slug}")

    listed, page = with_client(create_server(workspace), read)  # an empty workspace: the shipped library only
    assert page.contents[0].text == text
    described = {str(r.uri): r.description for r in listed.resources}
    assert described[f"axrl://method/{slug}"] == f"Mitigation method {slug} (shipped with the tool)"

    own = workspace / "spike-mitigation-methods" / f"{slug}.md"  # the workspace's file of the same name wins
    own.parent.mkdir()
    own.write_text("# advantage-clip-1\n\nThis workspace's own write-up.\n", encoding="utf-8")
    listed, page = with_client(create_server(workspace), read)
    assert page.contents[0].text == own.read_text(encoding="utf-8")
    described = {str(r.uri): r.description for r in listed.resources}
    assert described[f"axrl://method/{slug}"] == f"Mitigation method {slug}"
