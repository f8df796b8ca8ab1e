"""An engineer investigates a spike: opens a task, replays, writes up what worked, reports and releases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from record_helpers import JOB, MEDIAN, RECORDED, SpikeRun, replay_result, save_result

from axrl_spike_replay.cli import main
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, iteration_dir_name
from axrl_spike_replay.snapshot.preservation.preserve import preserve
from axrl_spike_replay.workspace.method_files import front_matter
from axrl_spike_replay.workspace.task_record.task_log import record_failure, record_replay


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the CLI in-process; (exit status, stdout, stderr)."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    status, out, err = cli(capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


def test_investigation_from_open_to_report(tmp_path: Path, spike_run: SpikeRun, capsys) -> None:
    ws = str(tmp_path)
    snapshot = spike_run.snapshot
    preserve(spike_run.output_dir, spike_run.iteration)
    preserved = spike_run.output_dir / PRESERVED_DIR / iteration_dir_name(spike_run.iteration)
    assert preserved.is_dir()

    # Open the task with the spike snapshot; the task file has every section.
    opened = cli_json(capsys, "task", "open", JOB, "--snapshot", str(snapshot), "--workspace", ws)
    assert opened["snapshot"] == str(snapshot.resolve())
    task_md = tmp_path / "agent-task" / "spike-replay" / f"{JOB}.md"
    text = task_md.read_text()
    for section in ("Active snapshot", "Replay command", "Experiment table", "Observations", "Failed attempts"):
        assert f"## {section}" in text
    assert "## Next steps" in text
    assert cli(capsys, "task", "set-command", JOB, "axrl-spike-replay replay SNAP", "--workspace", ws)[0] == 0

    # Replays log themselves: a baseline that reproduces the spike, then mitigations.
    runs = [
        ("baseline", replay_result(snapshot, 37.4189, "reproduced")),
        ("tis2", replay_result(snapshot, 3.812, "cleared", mitigations={"mismatch_token_clip_max": 2.5})),
        ("r3-loss", replay_result(snapshot, 20.95, "partial", mitigations={"routing": {"replay": "loss_tokens"}})),
        ("advclip", replay_result(snapshot, 37.1, "no_effect", mitigations={"advantage_clip": 5})),
        (
            "r3-off-1rank",
            replay_result(
                snapshot,
                4.4,
                "cleared",
                mitigations={"routing": {"replay": "off"}},
                fidelity="reduced",
                world_size_used=1,
            ),
        ),
        ("tis2-again", replay_result(snapshot, 3.812, "cleared", mitigations={"mismatch_token_clip_max": "2.5"})),
    ]
    baseline_norm = runs[0][1].grad_norm
    ids = []
    for name, result in runs:
        if result.mitigations:
            result.baseline_grad_norm = baseline_norm
            result.change_vs_baseline = result.grad_norm / baseline_norm - 1
        ids.append(record_replay(tmp_path, JOB, result, save_result(tmp_path, name, result)))
    assert ids == ["E1", "E2", "E3", "E4", "E5", "E6"]
    fail_id = record_failure(
        tmp_path,
        JOB,
        reason="patch did not apply: hunk #1 FAILED",
        command="replay --patch fix.diff",
        snapshot=str(snapshot),
    )
    assert fail_id == "F1"
    assert cli(capsys, "task", "note", JOB, "--section", "observations", "TIS clears it", "--workspace", ws)[0] == 0
    assert cli(capsys, "task", "note", JOB, "--section", "next-steps", "try on the node", "--workspace", ws)[0] == 0

    shown = cli_json(capsys, "task", "show", JOB, "--workspace", ws)
    rows = {row["id"]: row for row in shown["experiments"]}
    assert [rows[i]["verdict"] for i in ids] == ["reproduced", "cleared", "partial", "no_effect", "cleared", "cleared"]
    assert rows["E1"]["grad_norm"] == pytest.approx(37.4189)
    assert rows["E1"]["ratio_to_median"] == pytest.approx(37.4189 / MEDIAN)
    assert rows["E2"]["mitigations"] == {"mismatch_token_clip_max": 2.5}
    assert rows["E2"]["change_vs_baseline"] == pytest.approx(3.812 / 37.4189 - 1)
    assert rows["E2"]["result_path"].endswith("tis2/replay_result.json")
    assert rows["E5"]["fidelity"] == "reduced"
    for key in ("id", "time", "snapshot", "backend", "target", "fidelity", "mitigations", "verdict", "result_path"):
        assert key in rows["E3"]
    assert shown["failed"][0]["reason"] == "patch did not apply: hunk #1 FAILED"
    assert shown["observations"][0]["text"].startswith("diagnose (iteration")  # written by `task open --snapshot`
    assert shown["observations"][-1]["text"] == "TIS clears it"
    assert shown["next_steps"][-1]["text"] == "try on the node"
    assert shown["command"] == "axrl-spike-replay replay SNAP"
    text = task_md.read_text()
    assert "| E2 |" in text and "mismatch_token_clip_max=2.5" in text and "hunk #1 FAILED" in text

    # Write up the cleared attempt.
    rationale = "Clipping the token-level importance ratio against the rollout at 2 removes the off-policy tokens."
    added = cli_json(
        capsys, "method", "add", "--job", JOB, "--attempt", "E2", "--name", "tis-clip-2", "--rationale", rationale,
        "--workspace", ws,
    )  # fmt: skip
    method_md = tmp_path / "spike-mitigation-methods" / "tis-clip-2.md"
    assert added["path"] == str(method_md) and added["status"] == "proven"
    fields = front_matter.load(method_md)
    assert fields["mitigations"] == {"mismatch_token_clip_max": 2.5}
    assert fields["baseline_grad_norm"] == pytest.approx(37.4189)
    body = method_md.read_text()
    assert f"| job | {JOB} |" in body and "| role | actor |" in body
    assert f"| snapshot | {snapshot} |" in body
    assert f"| output dir | {spike_run.output_dir} |" in body
    assert "| grad norm | 37.42 | 3.812 |" in body
    assert f"| ratio to median | {37.4189 / MEDIAN:.4g} | {3.812 / MEDIAN:.4g} |" in body
    assert f"| rel diff vs recorded | {abs(37.4189 - RECORDED) / RECORDED:.4g} |" in body
    assert "| fidelity | full | full |" in body
    assert "no residual spike" in body and rationale in body
    signals = body.split("## Key signals")[1].split("## Change")[0]
    assert "- spike: recorded grad norm 37.42, 12.86x the median 2.91 (iteration 5, world size 2)" in signals
    assert "- baseline replay E1: grad norm 37.42" in signals  # from the baseline's replay_result.json
    assert "per-sample attribution: not measured" in signals  # no attribution.json in the job's runs

    # Refusals: the same config again (written differently), a no-effect attempt, reduced fidelity without the flag.
    status, _, err = cli(capsys, "method", "add", "--job", JOB, "--attempt", "E6", "--name", "tis", "--rationale", "x",
                         "--workspace", ws)  # fmt: skip
    assert status == 2 and "duplicate" in err and "tis-clip-2.md" in err
    status, _, err = cli(capsys, "method", "add", "--job", JOB, "--attempt", "E4", "--name", "adv", "--rationale", "x",
                         "--workspace", ws)  # fmt: skip
    assert status == 2 and "'no_effect'" in err
    status, _, err = cli(capsys, "method", "add", "--job", JOB, "--attempt", "E5", "--name", "r3-off", "--rationale",
                         "x", "--workspace", ws)  # fmt: skip
    assert status == 2 and "reduced" in err and "--allow-reduced" in err
    assert not (tmp_path / "spike-mitigation-methods" / "r3-off.md").exists()

    diag = cli_json(capsys, "method", "add", "--job", JOB, "--attempt", "E5", "--name", "r3-off", "--rationale",
                    "Routes differ between rollout and training.", "--allow-reduced", "--workspace", ws)  # fmt: skip
    assert diag["status"] == "diagnostic"
    assert "DIAGNOSTIC ONLY — REDUCED FIDELITY" in Path(diag["path"]).read_text()
    partial = cli_json(capsys, "method", "add", "--job", JOB, "--attempt", "e3", "--name", "r3-loss-tokens",
                       "--rationale", "Replay routes only where the loss is taken.", "--workspace", ws)  # fmt: skip
    assert partial["status"] == "partial"
    assert "residual spike: ratio to median 7.199" in Path(partial["path"]).read_text()

    listed = cli_json(capsys, "method", "list", "--workspace", ws)
    assert {m["slug"]: m["status"] for m in listed if m["source"] == "workspace"} == {
        "tis-clip-2": "proven",
        "r3-off": "diagnostic",
        "r3-loss-tokens": "partial",
    }
    index = (tmp_path / "spike-mitigation-methods" / "README.md").read_text()
    assert "| [tis-clip-2](tis-clip-2.md) | proven |" in index and "| [r3-off](r3-off.md) | diagnostic |" in index

    # Re-opening keeps every row.
    reopened = cli_json(capsys, "task", "open", JOB, "--workspace", ws)
    assert len(reopened["experiments"]) == 6 and len(reopened["methods"]) == 3

    # The report, field by field, then the preserved copy is released.
    report = cli_json(capsys, "report", JOB, "--release", "--workspace", ws)
    report_md = tmp_path / "tmp" / "spike-replay" / JOB / "report.md"
    assert report["path"] == str(report_md)
    assert report["output_dir"] == str(spike_run.output_dir)
    assert report["snapshot"] == str(snapshot.resolve())
    assert report["fidelity"] == [
        {
            "target": "local",
            "backend": "torch",
            "full": True,
            "device": "cpu",
            "world_sizes": [{"used": 1, "saved": 2}, {"used": 2, "saved": 2}],
        }
    ]
    assert [b["id"] for b in report["baselines"]] == ["E1"]
    assert report["baselines"][0]["rel_diff"] == pytest.approx(abs(37.4189 - RECORDED) / RECORDED)
    assert [a["id"] for a in report["attempts"]] == ["E2", "E3", "E4", "E5", "E6"]
    assert [m["slug"] for m in report["methods"]] == ["tis-clip-2", "r3-loss-tokens", "r3-off"]  # ranked
    assert report["released"] == [
        {
            "output_dir": str(spike_run.output_dir),
            "iteration": spike_run.iteration,
            "path": str(preserved),
            "released": True,
            "error": None,
        }
    ]
    assert not preserved.exists() and snapshot.is_dir()
    md = report_md.read_text()
    assert md == report["text"]
    assert f"| output dir | {spike_run.output_dir} |" in md
    assert f"| selected snapshot | {snapshot.resolve()} |" in md
    assert "`local` (torch, cpu): **full-fidelity replay was possible**" in md
    it = spike_run.iteration
    rel = abs(37.4189 - RECORDED) / RECORDED  # E5 ran at another layout: judged against no logged baseline
    assert f"| E1 | {it} |  (baseline of E2, E3, E4, E6) | local | full | 2/2 | 37.42 | 37.42 | {rel:.4g} |" in md
    assert f"| E2 | {it} | mismatch_token_clip_max=2.5 | local | full | 3.812 | {3.812 / MEDIAN:.4g} | -89.8% |" in md
    assert f"| E4 | {it} | advantage_clip=5 | local | full | 37.1 |" in md and "| no_effect |" in md
    assert f"| E5 | {it} | routing.replay=off | local | reduced | 4.4 |" in md
    assert "| rel diff | verdict | result |" not in md  # a mitigated row's distance from the recording is no fidelity
    assert "| F1 | local | replay --patch fix.diff | patch did not apply: hunk #1 FAILED |" in md
    assert "| tis-clip-2 | E2 | proven |" in md and "| r3-off | E5 | diagnostic |" in md
    # written again after the release: it says what happened and names only what still exists
    assert f"- `{preserved}`: released after this investigation. The snapshot stays at `{snapshot.resolve()}`" in md
    assert "release requested" not in md
    assert cli_json(capsys, "task", "show", JOB, "--workspace", ws)["reports"][0]["released"][0]["released"] is True


def test_report_shows_the_baseline_computed_alongside_a_mitigated_replay(tmp_path: Path, spike_run: SpikeRun) -> None:
    from axrl_spike_replay.investigation.task_opening import open_task
    from axrl_spike_replay.workspace.report import write_report

    open_task(tmp_path, JOB, snapshot=spike_run.snapshot)
    result = replay_result(spike_run.snapshot, 3.9, "cleared", mitigations={"mismatch_token_clip_max": 2.5})
    result.baseline_grad_norm, result.change_vs_baseline = 37.4, 3.9 / 37.4 - 1
    record_replay(tmp_path, JOB, result, save_result(tmp_path, "tis", result))
    report = write_report(tmp_path, JOB)
    assert report.baselines == [] and [b["id"] for b in report.attempt_baselines] == ["E1"]
    assert f"| E1 | local | full | 2/2 | 37.4 | 37.42 | {abs(37.4 - RECORDED) / RECORDED:.4g} |" in report.text
    assert report.released == []


def test_task_show_gives_the_change_as_the_files_do(tmp_path: Path, spike_run: SpikeRun, capsys) -> None:
    from axrl_spike_replay.investigation.task_opening import open_task

    open_task(tmp_path, JOB, snapshot=spike_run.snapshot)
    result = replay_result(spike_run.snapshot, 3.9, "cleared", mitigations={"mismatch_token_clip_max": 2.5})
    result.baseline_grad_norm, result.change_vs_baseline = 37.4, 3.9 / 37.4 - 1
    record_replay(tmp_path, JOB, result, save_result(tmp_path, "tis", result))
    capsys.readouterr()
    assert main(["task", "show", JOB, "--workspace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "change vs baseline" in out and "-89.6%" in out  # as in the task file and the report
