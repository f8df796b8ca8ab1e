"""An agent finds a job, preserves its snapshot, reads it and releases it — through MCP tool calls only."""

from __future__ import annotations

from pathlib import Path

from server_helpers import ITERATION, JOB, RECORDED, SpikeOutputs, call, error_text, ok

from axrl_spike_replay.snapshot.layout import PRESERVED_DIR


def test_resolve_job_finds_the_actor_dir_and_its_log(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    found = ok(call(workspace, "resolve_job", {"job": JOB, "roots": [str(spike_outputs.root)]}))
    assert found["job"] == JOB
    [role] = found["roles"]
    assert role["role"] == "actor"
    assert role["output_dir"] == str(spike_outputs.output_dir)
    assert role["logs"] == [str(spike_outputs.log)]


def test_resolve_job_searches_the_workspace_by_default(spike_outputs: SpikeOutputs, monkeypatch) -> None:
    monkeypatch.delenv("AXRL_OUTPUT_ROOTS", raising=False)
    found = ok(call(spike_outputs.root, "resolve_job", {"job": JOB}))
    assert [r["role"] for r in found["roles"]] == ["actor"]


def test_unknown_job_is_a_tool_error_that_says_where_it_looked(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    text = error_text(call(workspace, "resolve_job", {"job": "no-such-job", "roots": [str(spike_outputs.root)]}))
    assert "no-such-job" in text and str(spike_outputs.root) in text
    assert "Traceback" not in text


def test_preserve_inspect_release_round_trip(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    out = str(spike_outputs.output_dir)
    listing = ok(call(workspace, "list_snapshots", {"output_dir": out}))
    assert [(s["iteration"], s["preserved"]) for s in listing["snapshots"]] == [(ITERATION, False)]

    preserved = ok(call(workspace, "preserve_snapshots", {"output_dir": out, "iteration": ITERATION}))
    [copy] = preserved["preserved"]
    copy_path = Path(copy["path"])
    assert copy_path.parent == spike_outputs.output_dir / PRESERVED_DIR
    assert copy["linked_files"] > 0 and copy["copied_files"] == 0
    again = ok(call(workspace, "preserve_snapshots", {"output_dir": out, "iteration": ITERATION}))
    assert again["preserved"][0]["status"] == "already_preserved"

    seen = ok(call(workspace, "inspect_snapshot", {"snapshot": str(copy_path)}))
    assert (seen["job_name"], seen["iteration"], seen["world_size"]) == (JOB, ITERATION, 2)
    assert seen["grad_norm"] == RECORDED
    assert [r["rank"] for r in seen["ranks"]] == [0, 1]
    assert seen["problems"] == []

    released = ok(call(workspace, "release_preserved", {"output_dir": out, "iteration": ITERATION}))
    assert [r["path"] for r in released["released"]] == [str(copy_path)]
    assert not copy_path.exists()
    assert spike_outputs.snapshot.is_dir()  # the retained snapshot is never touched


def test_paths_are_relative_to_the_workspace(spike_outputs: SpikeOutputs) -> None:
    relative = spike_outputs.snapshot.relative_to(spike_outputs.root)
    seen = ok(call(spike_outputs.root, "inspect_snapshot", {"snapshot": str(relative)}))
    assert seen["iteration"] == ITERATION


def test_a_missing_snapshot_is_a_tool_error_naming_it(workspace: Path) -> None:
    text = error_text(call(workspace, "inspect_snapshot", {"snapshot": "/no/such/iter_0000007"}))
    assert "/no/such/iter_0000007" in text and "not found" in text


def test_a_bad_argument_is_a_tool_error_naming_the_argument(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    text = error_text(
        call(workspace, "preserve_snapshots", {"output_dir": str(spike_outputs.output_dir), "iteration": -3})
    )
    assert "iteration" in text and "greater than or equal to 0" in text
    text = error_text(call(workspace, "inspect_snapshot", {}))
    assert "snapshot" in text and "Field required" in text


def test_release_refuses_what_it_did_not_preserve(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    text = error_text(
        call(workspace, "release_preserved", {"output_dir": str(spike_outputs.output_dir), "iteration": ITERATION})
    )
    assert "no preserved copy" in text
    assert spike_outputs.snapshot.is_dir()


def test_prepare_replay_dir_says_a_current_snapshot_needs_nothing(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    prepared = ok(call(workspace, "prepare_replay_dir", {"snapshot": str(spike_outputs.snapshot)}))
    assert prepared["legacy"] is False
    assert prepared["replay_dir"] == str(spike_outputs.snapshot)


def test_a_legacy_snapshot_is_read_and_prepared_without_touching_it(fixture_outputs: Path, workspace: Path) -> None:
    [snapshot] = sorted((fixture_outputs / "fx~fixture-legacy__actor" / "checkpoints" / "spike_snapshots").iterdir())
    before = (snapshot / "metadata.json").read_text()
    seen = ok(call(workspace, "inspect_snapshot", {"snapshot": str(snapshot)}))
    assert seen["legacy_metadata"] is True
    prepared = ok(call(workspace, "prepare_replay_dir", {"snapshot": str(snapshot), "dest": "replay-dir"}))
    assert prepared["legacy"] is True and Path(prepared["replay_dir"]) == workspace / "replay-dir"
    assert (workspace / "replay-dir" / "axrl_metadata.json").is_file()
    assert (snapshot / "metadata.json").read_text() == before


def test_inspect_snapshot_shows_the_run_configs_loss_routing_parallel_and_detector(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    import yaml

    recorded = yaml.safe_load((spike_outputs.snapshot / "run_config.yaml").read_text())
    seen = ok(call(workspace, "inspect_snapshot", {"snapshot": str(spike_outputs.snapshot)}))
    for name in ("loss", "routing", "parallel"):
        assert seen["settings"][name] == recorded[name]
    assert seen["settings"]["detector"]["kind"] == (recorded.get("detector") or {}).get("kind", "median_ratio")


def test_preserve_into_the_workspace_writes_nothing_under_the_output_root(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    out = str(spike_outputs.output_dir)
    before = sorted(p.relative_to(spike_outputs.output_dir) for p in spike_outputs.output_dir.rglob("*"))
    preserved = ok(call(workspace, "preserve_snapshots", {"output_dir": out, "into_workspace": True}))
    assert preserved["in_workspace"] and "no writes" in preserved["reason"]
    [copy] = preserved["preserved"]
    assert Path(copy["path"]).is_relative_to(workspace) and copy["linked_files"] > 0
    assert sorted(p.relative_to(spike_outputs.output_dir) for p in spike_outputs.output_dir.rglob("*")) == before
    seen = ok(call(workspace, "inspect_snapshot", {"snapshot": copy["path"]}))
    assert seen["problems"] == []
    released = ok(call(workspace, "release_preserved", {"output_dir": out, "in_workspace": True}))
    assert [r["path"] for r in released["released"]] == [copy["path"]] and not Path(copy["path"]).exists()
