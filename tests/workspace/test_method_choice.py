"""Choosing between proven methods: ranked by how intact they leave the healthy gradient, shipped methods listed
beside the workspace's, diagnostics refused, a shipped change confirmed rather than duplicated, and the report
shows what was run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from record_helpers import JOB, SpikeRun, replay_result, save_result

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.method_files.methods import add_method, list_methods, rank_key
from axrl_spike_replay.workspace.report import write_report
from axrl_spike_replay.workspace.task_record.task_log import record_replay
from axrl_spike_replay.workspace.task_record.task_state import read_state, set_command

BASE = 37.42


def _log(workspace: Path, snapshot: Path, name: str, grad_norm: float, mitigations: dict, cos: float | None,
         tokens: float, command: str | None = None) -> str:  # fmt: skip
    extra = {}
    if mitigations:
        extra = {
            "mitigations": mitigations,
            "baseline_grad_norm": BASE,
            "change_vs_baseline": grad_norm / BASE - 1,
            "cosine_to_clean": cos,
            "footprint": {
                "token_fraction": tokens,
                "sample_fraction": tokens,
                "masked_tokens": 1,
                "changed_tokens": 0,
                "loss_tokens": 32,
                "touched_samples": 1,
                "samples": 4,
            },
            "clean_gradient": {"left_out": ["0:1"], "share_left_out": 0.97, "baseline_cosine": 0.1},
        }
    verdict = "reproduced" if not mitigations else "cleared"
    result = replay_result(snapshot, grad_norm, verdict, **extra)
    path = save_result(workspace, name, result)
    if command:
        (path.parent / "command.txt").write_text(command + "\n")
    exp_id = record_replay(workspace, JOB, result, path)
    assert exp_id is not None
    return exp_id


@pytest.fixture
def investigated(tmp_path: Path, spike_run: SpikeRun) -> tuple[Path, dict[str, str]]:
    open_task(tmp_path, JOB, str(spike_run.snapshot))
    snap = spike_run.snapshot
    ids = {
        "baseline": _log(tmp_path, snap, "base", BASE, {}, None, 0.0, command=f"axrl-spike-replay replay {snap}"),
        "mask": _log(
            tmp_path, snap, "mask", 2.0, {"advantage_outlier_mask": {"scope": "batch", "threshold": 5.0}}, 0.9999, 0.03
        ),
        "clip": _log(tmp_path, snap, "clip", 2.5, {"advantage_clip": 2.0}, 0.65, 0.2),
        "drop": _log(tmp_path, snap, "drop", 2.0, {"drop_samples": ["0:1"]}, 1.0, 0.03),
        "dup": _log(tmp_path, snap, "dup", 2.2, {"advantage_clip": 1.0}, 0.6, 0.2),
    }
    return tmp_path, ids


@pytest.mark.slow
def test_methods_are_ranked_by_how_intact_they_leave_the_clean_gradient(
    investigated: tuple[Path, dict[str, str]],
) -> None:
    workspace, ids = investigated
    add_method(workspace, JOB, ids["clip"], "clip-2", "clamps the outlier advantage")
    add_method(workspace, JOB, ids["mask"], "mask-outliers", "masks the mis-scaled sample")
    methods = list_methods(workspace)
    own = [m.slug for m in methods if m.source == "workspace"]
    assert own == ["mask-outliers", "clip-2"]  # cosine 0.9999 before 0.65, whatever order they were added in
    shipped = [m for m in methods if m.source == "shipped"]
    assert {"advantage-clip-1", "ratio-outlier-mask"} <= {m.slug for m in shipped}
    assert [m.rank for m in methods] == list(range(1, len(methods) + 1))
    mine = [m for m in methods if m.source == "workspace"]  # the shipped methods' figures are the last regeneration's
    assert mine[0].to_json()["cosine_to_clean"] == pytest.approx(0.9999)
    text = (workspace / "spike-mitigation-methods" / "mask-outliers.md").read_text()
    for heading in ("### Mechanism", "### Evidence", "### When not to use it"):
        assert heading in text
    assert "robust outlier" in text and "cosine to the clean gradient" in text and "rare but real reward" in text
    index = (workspace / "spike-mitigation-methods" / "README.md").read_text()
    assert index.index("mask-outliers") < index.index("clip-2")

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "mcp_server")}
    out = subprocess.run(
        [sys.executable, "-m", "axrl_spike_replay", "method", "list", "--workspace", str(workspace)],
        capture_output=True, text=True, env=env, check=True,
    ).stdout  # fmt: skip
    assert "cos to clean" in out and "0.9999" in out and "shipped" in out
    assert out.index("mask-outliers") < out.index("clip-2")

    report = write_report(workspace, JOB).text
    assert report.index("mask-outliers") < report.index("clip-2")
    assert "cosine to clean" in report


@pytest.mark.slow
def test_drop_samples_is_never_written_up_and_a_shipped_change_is_confirmed_not_duplicated(
    investigated: tuple[Path, dict[str, str]],
) -> None:
    workspace, ids = investigated
    with pytest.raises(AxrlError, match=r"diagnostic-only.*drop_samples"):
        add_method(workspace, JOB, ids["drop"], "drop-it", "left the sample out")
    assert not (workspace / "spike-mitigation-methods" / "drop-it.md").exists()
    added = add_method(workspace, JOB, ids["dup"], "clip-1", "clamps advantages")
    assert added.confirms_shipped == "advantage-clip-1"
    assert "shipped method `advantage-clip-1`" in Path(added.path).read_text()
    with pytest.raises(AxrlError, match=r"duplicate method: method file .*clip-1\.md"):
        add_method(workspace, JOB, ids["dup"], "clip-again", "clamps advantages")


def test_the_task_and_report_show_the_replay_command_actually_used(
    investigated: tuple[Path, dict[str, str]], spike_run: SpikeRun
) -> None:
    workspace, _ = investigated
    state = read_state(workspace, JOB)
    # as people rerun it from anywhere: the workspace named (the default is the directory it is run in)
    assert state.command == f"axrl-spike-replay replay {spike_run.snapshot} --workspace {workspace.resolve()}"
    assert "None recorded yet" not in (workspace / "agent-task" / "spike-replay" / f"{JOB}.md").read_text()
    set_command(workspace, JOB, "my own command")
    _log(workspace, spike_run.snapshot, "again", BASE, {}, None, 0.0, command="axrl-spike-replay replay other")
    assert read_state(workspace, JOB).command == "my own command"  # what the user set stays


def test_a_cosine_against_a_clean_gradient_that_never_got_under_the_bar_ranks_by_footprint_after_the_others() -> None:
    def fields(slug: str, cos: float | None, reached: bool | None, tokens: float) -> dict:
        return {"slug": slug, "status": "proven", "cosine_to_clean": cos, "clean_reached": reached,
                "token_fraction": tokens}  # fmt: skip

    methods = [
        fields("rough-close", 0.99, False, 0.9),
        fields("rough-small", 0.10, False, 0.1),
        fields("measured", 0.20, True, 0.5),
        fields("older-file", 0.30, None, 0.5),  # written before `clean_reached` was recorded: as before
        fields("no-figures", None, None, 0.0),
    ]
    ranked = [m["slug"] for m in sorted(methods, key=rank_key)]
    assert ranked == ["older-file", "measured", "rough-small", "rough-close", "no-figures"]


def test_method_list_at_the_checkout_labels_the_shipped_methods_shipped(tmp_path: Path) -> None:
    """Run from the repository root (where a newcomer stands), the workspace's folder is the shipped one."""
    repo = Path(__file__).resolve().parents[2]
    methods = list_methods(repo)
    shipped = {p.stem for p in (repo / "spike-mitigation-methods").glob("*.md")} - {"README"}
    assert shipped and {m.slug for m in methods} == shipped  # each listed once ...
    assert {m.source for m in methods} == {"shipped"}  # ... as what it is
    assert {m.source for m in list_methods(tmp_path)} == {"shipped"}  # and so from an empty workspace


@pytest.mark.slow
def test_method_add_answers_with_the_figures_its_file_holds(investigated: tuple[Path, dict[str, str]]) -> None:
    from axrl_spike_replay.jsonable import to_jsonable
    from axrl_spike_replay.mcp_faces.record_models import MethodAdded
    from axrl_spike_replay.workspace.method_files import front_matter

    workspace, ids = investigated
    added = add_method(workspace, JOB, ids["mask"], "mask-outliers", "masks the mis-scaled sample")
    written = front_matter.load(workspace / "spike-mitigation-methods" / "mask-outliers.md")
    assert written is not None
    listed = next(m for m in list_methods(workspace) if m.slug == "mask-outliers")
    answer = MethodAdded.model_validate(to_jsonable(added))  # what the MCP method_add tool returns
    assert answer.cosine_to_clean == written["cosine_to_clean"] == pytest.approx(0.9999)
    assert answer.token_fraction == written["token_fraction"] == pytest.approx(0.03)
    assert answer.clean_reached == written["clean_reached"]
    assert answer.rank == listed.rank >= 1
