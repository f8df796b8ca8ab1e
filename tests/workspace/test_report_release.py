"""`report --release` releases exactly the preserved copies this investigation uses, never a last copy unasked."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from record_helpers import JOB, MEDIAN, RECORDED, THRESHOLD

from axrl_spike_replay.cli import main
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, SNAPSHOTS_DIR, iteration_dir_name
from axrl_spike_replay.snapshot.preservation.preserve import preserve
from axrl_spike_replay.workspace.report import write_report
from axrl_spike_replay.workspace.task_record.task_state import set_snapshot, show_task
from tiny_spike import write_tiny_spike


@pytest.fixture(scope="module")
def two_jobs_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output root with two jobs' actor dirs, each with one real tiny snapshot (iteration 5)."""
    root = tmp_path_factory.mktemp("two-jobs")
    for job in (JOB, "other-job"):
        write_tiny_spike(root / f"run1~{job}__actor", job=job, iteration=5, recorded=RECORDED, median=MEDIAN,
                         threshold=THRESHOLD)  # fmt: skip
    return root


def _outputs(template: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "outputs"
    shutil.copytree(template, root)
    return root / f"run1~{JOB}__actor", root / "run1~other-job__actor"


def _copy(output_dir: Path) -> Path:
    return output_dir / PRESERVED_DIR / iteration_dir_name(5)


def _source(output_dir: Path) -> Path:
    return output_dir / SNAPSHOTS_DIR / iteration_dir_name(5)


def _task_on_a_preserved_copy(template: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Our job's output dir with iteration 5 preserved, and a workspace whose task points at that copy."""
    ours, _ = _outputs(template, tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    preserve(ours, 5)
    open_task(ws, JOB, _copy(ours))
    return ours, ws


def _report(capsys: pytest.CaptureFixture[str], ws: Path, *flags: str) -> tuple[int, dict, str]:
    status = main(["report", JOB, "--workspace", str(ws), "--json", *flags])
    out, err = capsys.readouterr()
    return status, json.loads(out), err


def test_a_replaced_snapshot_of_another_job_keeps_its_last_copy(
    two_jobs_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: the task first pointed at another job's snapshot, then at its own; the other job's
    source has since rotated away, so its preserved copy is the only one left."""
    ours, theirs = _outputs(two_jobs_template, tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    preserve(theirs, 5)
    preserve(ours, 5)
    open_task(ws, JOB, _copy(theirs))  # by mistake: the other job's snapshot
    set_snapshot(ws, JOB, _copy(ours))  # then the right one
    shutil.rmtree(_source(theirs))  # rotation: their preserved copy is now the last copy

    status, report, _ = _report(capsys, ws, "--release")

    assert status == 0
    assert [r["path"] for r in report["released"]] == [str(_copy(ours))]
    assert report["released"][0]["released"] is True
    assert not _copy(ours).exists() and _source(ours).is_dir()
    assert _copy(theirs).is_dir() and (_copy(theirs) / "axrl_metadata.json").is_file()
    (kept,) = report["preserved_kept"]
    assert kept["path"] == str(_copy(theirs)) and kept["reason"] == "not the task's current snapshot"
    assert f"`{_copy(theirs)}`: kept, not the task's current snapshot" in report["text"]


def test_the_last_copy_of_the_current_snapshot_needs_an_explicit_flag(
    two_jobs_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours, ws = _task_on_a_preserved_copy(two_jobs_template, tmp_path)
    shutil.rmtree(_source(ours))

    status, report, _ = _report(capsys, ws, "--release")

    assert status == 1
    (entry,) = report["released"]
    assert entry["released"] is False and "last copy of iteration 5" in entry["error"]
    assert "--release-last-copy" in entry["error"]
    assert _copy(ours).is_dir()
    assert report["preserved"][0]["last_copy"] is True
    assert "the last copy is released only with `--release-last-copy`" in report["text"]
    text_status = main(["report", JOB, "--workspace", str(ws), "--release"])
    assert text_status == 1 and "NOT released" in capsys.readouterr().out

    status, report, _ = _report(capsys, ws, "--release", "--release-last-copy")

    assert status == 0 and report["released"][0]["released"] is True and not _copy(ours).exists()


def test_a_copy_another_open_task_still_uses_is_kept(two_jobs_template: Path, tmp_path: Path) -> None:
    ours, ws = _task_on_a_preserved_copy(two_jobs_template, tmp_path)
    open_task(ws, "second-look", _copy(ours))

    report = write_report(ws, JOB, release=True)

    (entry,) = report.released
    assert entry["released"] is False and "task 'second-look' still uses it" in entry["error"]
    assert _copy(ours).is_dir()


def test_a_copy_made_again_after_the_task_noted_it_is_not_released(two_jobs_template: Path, tmp_path: Path) -> None:
    ours, _ = _outputs(two_jobs_template, tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    preserve(ours, 5)
    open_task(ws, JOB, _source(ours))
    assert [c["path"] for c in show_task(ws, JOB).preserved_copies] == [str(_copy(ours))]
    marker = _copy(ours) / ".axrl_preserved.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "created_at": "2031-01-01T00:00:00+00:00"}))

    report = write_report(ws, JOB, release=True)

    assert report.released == [] and _copy(ours).is_dir()
    assert "not noted as this investigation's copy" in report.preserved_kept[0]["reason"]


def test_after_release_the_task_points_at_the_rotating_snapshot_that_still_exists(
    two_jobs_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours, ws = _task_on_a_preserved_copy(two_jobs_template, tmp_path)
    assert main(["task", "set-command", JOB, f"axrl-spike-replay replay {_copy(ours)}", "--workspace", str(ws)]) == 0
    capsys.readouterr()

    status, report, _ = _report(capsys, ws, "--release")

    assert status == 0 and [r["released"] for r in report["released"]] == [True]
    task = show_task(ws, JOB)
    assert task.snapshot == str(_source(ours).resolve()) and Path(task.snapshot).is_dir()
    assert task.command == f"axrl-spike-replay replay {_source(ours).resolve()}"
    assert "agents call the MCP tool `write_report` with `release: true`" not in report["text"]  # released, not a hint

    # The report was written again after the release: the command a newcomer copies from it runs.
    text = (ws / "tmp" / "spike-replay" / JOB / "report.md").read_text()
    assert text == report["text"] and report["command"] == task.command and report["snapshot"] == task.snapshot
    command = text.split("Replay command:\n\n```bash\n", 1)[1].split("\n```", 1)[0]
    assert command == task.command
    assert f"| selected snapshot | {_source(ours).resolve()} |" in text
    assert f"- `{_copy(ours)}`: released after this investigation. The snapshot stays at `{_source(ours)}`" in text
    assert "release requested" not in text
    assert main([*shlex.split(command)[1:], "--nproc", "1", "--workspace", str(ws)]) == 0


def test_when_the_last_copy_is_released_the_report_says_its_command_cannot_run(
    two_jobs_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours, ws = _task_on_a_preserved_copy(two_jobs_template, tmp_path)
    assert main(["task", "set-command", JOB, f"axrl-spike-replay replay {_copy(ours)}", "--workspace", str(ws)]) == 0
    shutil.rmtree(_source(ours))  # rotation took the original
    capsys.readouterr()

    status, report, _ = _report(capsys, ws, "--release", "--release-last-copy")

    assert status == 0 and not _copy(ours).exists()
    text = report["text"]
    assert f"its snapshot `{_copy(ours)}` no longer exists (released, or\nrotated away), so it cannot run" in text
    assert f"- `{_copy(ours)}`: released after this investigation. It was the last copy of iteration 5" in text


def test_a_kept_copy_says_how_people_and_agents_release_it(
    two_jobs_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours, ws = _task_on_a_preserved_copy(two_jobs_template, tmp_path)
    _, report, _ = _report(capsys, ws)
    line = next(x for x in report["text"].splitlines() if str(_copy(ours)) in x and x.startswith("- "))
    assert f"people run `axrl-spike-replay report {JOB} --release --workspace {ws.resolve()}`" in line
    assert "agents call the MCP tool `write_report` with `release: true`" in line


def test_each_preserved_copy_is_its_own_bullet_line(
    two_jobs_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A task that used two preserved copies lists them as two bullets, one per line (they once ran together)."""
    ours, theirs = _outputs(two_jobs_template, tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    preserve(theirs, 5)
    preserve(ours, 5)
    open_task(ws, JOB, _copy(theirs))
    set_snapshot(ws, JOB, _copy(ours))

    status, report, _ = _report(capsys, ws)

    assert status == 0
    section = report["text"].split("## Preserved snapshots", 1)[1].split("\n## ", 1)[0]
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    assert len(bullets) == 2, section
    assert {str(_copy(theirs)), str(_copy(ours))} == {b.split("`")[1] for b in bullets}


def test_the_report_lists_every_copy_the_task_preserved_not_only_its_current_snapshots(
    two_jobs_template: Path, tmp_path: Path
) -> None:
    """The task first looked at the other job's iteration 5 (preserved under that output root), then at its own,
    preserved into the workspace (no writes wanted under the output root), and its own is preserved under the root
    too: the report's preserved list names all three copies, the one in use first (the only one released)."""
    ours, theirs = _outputs(two_jobs_template, tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    preserve(theirs, 5)
    open_task(ws, JOB, _copy(theirs))
    [in_workspace] = [Path(c.path) for c in preserve(ours, 5, workspace=ws, no_writes=True).preserved]
    assert in_workspace.is_dir() and in_workspace.is_relative_to(ws)
    preserve(ours, 5)
    set_snapshot(ws, JOB, _copy(ours))

    report = write_report(ws, JOB)

    listed = {p["path"]: p for p in report.preserved}
    assert set(listed) == {str(_copy(ours)), str(_copy(theirs)), str(in_workspace)}
    assert report.preserved[0]["path"] == str(_copy(ours)) and report.preserved[0]["in_use"] is True
    assert listed[str(_copy(theirs))]["in_use"] is False
    assert "in the workspace" in listed[str(in_workspace)]["reason"]
    for path in listed:
        assert f"`{path}`" in report.text

    released = write_report(ws, JOB, release=True).released
    assert [r["path"] for r in released] == [str(_copy(ours))]  # only the copy in use is released
    assert _copy(theirs).is_dir() and in_workspace.is_dir()
