"""A newcomer's first hour with the record, as tried from a fresh clone: every verb says which workspace it wrote
into, the commands written down for people run from any directory, method files name what still exists after the
release, a method's name says what its attempt changed, and the listings and the report read cleanly."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
from record_helpers import JOB, MEDIAN, RECORDED, THRESHOLD, replay_result, save_result

from axrl_spike_replay.cli import main
from axrl_spike_replay.investigation.recording import WorkspaceRecorder
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, SNAPSHOTS_DIR, iteration_dir_name
from axrl_spike_replay.snapshot.preservation.preserve import preserve
from axrl_spike_replay.workspace.method_files import front_matter
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.paths import in_workspace
from axrl_spike_replay.workspace.report import write_report
from axrl_spike_replay.workspace.task_record.task import TaskState
from axrl_spike_replay.workspace.task_record.task_diagnosis import add_diagnosis
from axrl_spike_replay.workspace.task_record.task_log import record_replay
from axrl_spike_replay.workspace.task_record.task_state import read_state
from tiny_spike import write_tiny_spike

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
ROM = {"ratio_outlier_mask": {"base": "rollout", "high": 2.0, "level": "token", "low": 0.5}}
TIS = {"mismatch_token_clip_max": 2.0}


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def spike_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output dir with one real tiny snapshot (iteration 5), copied per test."""
    out = tmp_path_factory.mktemp("first-hour") / f"run1~{JOB}__actor"
    write_tiny_spike(out, job=JOB, iteration=5, recorded=RECORDED, median=MEDIAN, threshold=THRESHOLD)
    return out


@pytest.fixture
def investigated(spike_template: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(workspace, output dir, preserved copy): the task on the preserved copy of iteration 5, with a baseline E1
    and two cleared attempts, E2 (truncated importance sampling) and E3 (the ratio outlier mask), each with the
    command line its run dir records."""
    output = tmp_path / "outputs" / spike_template.name
    shutil.copytree(spike_template, output)
    preserve(output, 5)
    copy = output / PRESERVED_DIR / iteration_dir_name(5)
    ws = tmp_path / "ws"
    ws.mkdir()
    open_task(ws, JOB, copy, diagnosis="off")
    base = 37.4189
    for name, grad, verdict, mitigations in (("baseline", base, "reproduced", {}), ("tis", 3.8, "cleared", TIS),
                                             ("rom", 4.1, "cleared", ROM)):  # fmt: skip
        result = replay_result(copy, grad, verdict, mitigations=mitigations)
        if mitigations:
            result.baseline_grad_norm, result.change_vs_baseline = base, grad / base - 1
        path = save_result(ws, name, result)
        (path.parent / "command.txt").write_text(f"axrl-spike-replay replay {shlex.quote(str(copy))}\n")
        record_replay(ws, JOB, result, path)
    return ws, output, copy


def test_each_verb_says_which_workspace_it_wrote_into(investigated: tuple[Path, Path, Path], capsys) -> None:
    ws, _, copy = investigated
    root = ws.resolve()
    said: list[str] = []
    WorkspaceRecorder(ws, progress=said.append).open_run(JOB)
    WorkspaceRecorder(ws, progress=said.append).open_run("no-such-job")
    assert said[0].startswith(f"workspace {root}: output in {root}/tmp/spike-replay/{JOB}/")
    assert said[0].endswith(f"; logged in the task file {root}/agent-task/spike-replay/{JOB}.md")
    assert said[1].endswith(
        "; no task is open for job no-such-job there, so the run is not logged in a task file "
        f"(`axrl-spike-replay task open no-such-job --workspace {root}` opens one)"
    )
    status, out, _ = _run(capsys, "task", "show", JOB, "--workspace", ws)
    assert status == 0 and out.startswith(f"task {JOB} in workspace {root}: {root}/agent-task/spike-replay/{JOB}.md")
    status, out, _ = _run(capsys, "report", JOB, "--workspace", ws)
    assert status == 0 and f"report of workspace {root} written to {root}/tmp/spike-replay/{JOB}/report.md" in out
    status, out, _ = _run(capsys, "diagnose", copy, "--model", "never", "--workspace", ws)
    kept = f"kept in the task file {root}/agent-task/spike-replay/{JOB}.md (workspace {root})\n"
    assert status == 0 and out.endswith(kept)
    elsewhere = ws.parent / "elsewhere"
    elsewhere.mkdir()
    status, out, _ = _run(capsys, "diagnose", copy, "--model", "never", "--workspace", elsewhere)
    assert status == 0 and f"not kept: no task is open for job {JOB} in workspace {elsewhere.resolve()}" in out


def test_the_commands_written_for_people_name_the_workspace(investigated: tuple[Path, Path, Path]) -> None:
    ws, _, copy = investigated
    root = ws.resolve()
    state = read_state(root, JOB)
    assert state.command == f"axrl-spike-replay replay {shlex.quote(str(copy))} --workspace {root}"
    assert all(str(row.command).endswith(f" --workspace {root}") for row in state.experiments)
    task = (root / "agent-task" / "spike-replay" / f"{JOB}.md").read_text()
    assert f"CLI: `axrl-spike-replay task ... --workspace {root}`" in task
    method = add_method(ws, JOB, "E2", "tis-clip-2", "Truncates the importance weights at 2.")
    replay = Path(method.path).read_text().split("## Replay it\n\n```bash\n", 1)[1].split("\n```", 1)[0]
    assert replay.endswith(f"--mitigation mismatch_token_clip_max=2.0 --workspace {root}")
    # a command already naming a workspace, a trainer's own command, a task whose job is not the snapshot's
    assert in_workspace("axrl-spike-replay sweep S --workspace /w", root) == "axrl-spike-replay sweep S --workspace /w"
    assert in_workspace("torchrun train.py --replay", root) == "torchrun train.py --replay"
    assert in_workspace("axrl-spike-replay replay S", root, "mine", "theirs") == (
        f"axrl-spike-replay replay S --workspace {root} --job mine"
    )


def test_after_the_release_method_files_name_the_snapshot_that_still_exists(
    investigated: tuple[Path, Path, Path], capsys
) -> None:
    ws, output, copy = investigated
    source = output / SNAPSHOTS_DIR / iteration_dir_name(5)
    path = Path(add_method(ws, JOB, "E2", "tis-clip-2", "Truncates the importance weights at 2.").path)
    before = path.read_text()
    assert f"| snapshot | {copy} |" in before and front_matter.load(path)["snapshot"] == str(copy)

    report = write_report(ws, JOB, release=True)

    assert report.released[0]["released"] is True and not copy.exists() and source.is_dir()
    fields = front_matter.load(path)
    assert fields["snapshot"] == str(source) and fields["released_copy"] == str(copy)
    after = path.read_text()
    assert f"| snapshot | {source} |" in after and f"| snapshot | {copy} |" not in after
    assert f"| replayed from | {copy}, a preserved copy released {fields['released_at']} |" in after
    assert f"`{copy}`, which was released {fields['released_at']} (`report --release`)" in after
    # every other line as written: the evidence, the rationale
    unchanged = [line for line in before.splitlines() if str(copy) not in line]
    assert [line for line in unchanged if line not in after.splitlines()] == []
    assert write_report(ws, JOB, release=True).released == []  # nothing left to release: the files stay as they are
    assert path.read_text() == after


def test_a_name_that_says_another_mitigation_is_written_with_a_warning(
    investigated: tuple[Path, Path, Path], capsys
) -> None:
    ws, _, _ = investigated
    status, out, _ = _run(capsys, "method", "add", "--job", JOB, "--attempt", "E3", "--name", "tis-clip-2",
                          "--rationale", "why", "--workspace", ws)  # fmt: skip
    assert status == 0 and (ws / "spike-mitigation-methods" / "tis-clip-2.md").is_file()
    assert (
        "warning: the name 'tis-clip-2' says `mismatch_token_clip_max`, but the attempt ran `ratio_outlier_mask`"
    ) in out
    right = add_method(ws, JOB, "E2", "token-mismatch-clip", "Truncates the importance weights at 2.")
    assert right.warnings == []
    own = (ws / "spike-mitigation-methods" / "token-mismatch-clip.md").read_text()
    assert "## Rationale\n\nTruncates the importance weights at 2." in own


def test_method_list_lists_the_shipped_methods_apart(investigated: tuple[Path, Path, Path], capsys) -> None:
    ws, _, _ = investigated
    add_method(ws, JOB, "E2", "tis-clip-2", "truncates the importance weights at 2")  # the shipped change again
    status, out, _ = _run(capsys, "method", "list", "--workspace", ws)
    assert status == 0
    ours, shipped = out.split("\n\n")
    assert ours.startswith("methods of this workspace") and " tis-clip-2 " in ours and "token-mismatch" not in ours
    assert shipped.startswith("shipped with the tool (measured on the reference trainer's spikes, not on yours")
    [row] = [line for line in shipped.splitlines() if " token-mismatch-tis-clip-2 " in line]
    assert "(same change as this workspace's tis-clip-2)" in row and "ref-ratio-outliers" in row
    text = (ws / "spike-mitigation-methods" / "tis-clip-2.md").read_text()
    assert "## Rationale\n\ntruncates the importance weights at 2" in text  # the rationale people type: as typed


def test_a_written_up_rationale_reads_as_a_sentence() -> None:
    """The rationale `demo` and sweep write-ups compose starts from a mitigation's documentation (`mask tokens ...`)."""
    from axrl_spike_replay.workspace.method_files.sweep_writeup import as_sentence, rationale_for

    result = replay_result(Path("/s"), 1.4, "cleared", mitigations=ROM, baseline_grad_norm=37.4)
    assert rationale_for(result, THRESHOLD).startswith("Mask tokens (or whole sequences")
    assert rationale_for(result, THRESHOLD, "Preset x: ").startswith("Preset x: mask tokens")
    assert [as_sentence(t) for t in ("clamp it", "ratio_outlier_mask masks", "`x` y", "iPhone")] == [
        "Clamp it", "ratio_outlier_mask masks", "`x` y", "iPhone"]  # fmt: skip


def test_the_report_reads_cleanly_and_says_once_what_megatron_lm_users_change(
    investigated: tuple[Path, Path, Path],
) -> None:
    ws, _, _ = investigated
    add_method(ws, JOB, "E2", "tis-clip-2", "Truncates the importance weights at 2.")
    text = write_report(ws, JOB).text
    assert "3 replays, 0 failed attempts, 1 method written up." in text  # not "1 methods"
    assert "read them.Best" not in text and "read them.\nBest-ranked first" in text
    assert text.count("**On Megatron-LM:**") == 1
    assert "Megatron-LM trains the model but computes no RL loss, so it has no flag for\nthese methods" in text
    method = (ws / "spike-mitigation-methods" / "tis-clip-2.md").read_text()
    assert "| Megatron-LM | mismatch_token_clip_max | none | no flag" in method  # where the report's sentence points


def test_task_open_indents_each_causes_evidence_under_it(tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "outputs" / FIXTURE.name
    shutil.copytree(FIXTURE, out_dir)
    ws = tmp_path / "ws"
    ws.mkdir()
    status, out, _ = _run(capsys, "task", "open", "fixture-moe", "--snapshot",
                          out_dir / SNAPSHOTS_DIR / "iter_0000021", "--workspace", ws)  # fmt: skip
    assert status == 0
    notes = out.split("observations:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert notes[0].startswith("  - diagnose (iteration 21): cause 1 of 2: rollout/trainer log-prob mismatch")
    assert notes[1].startswith("    - max |log(π_old/π_rollout)| on loss tokens")  # under its cause
    assert all(line.startswith(("  - ", "    - ")) for line in notes), notes


def _entry(model: str, steps: list[str], not_checked: list[str]) -> dict:
    return {
        "snapshot": "/s/iter_0000021",
        "iteration": 21,
        "model": model,
        "causes": [],
        "not_checked": not_checked,
        "next_steps": [{"mitigation": m, "why": "w", "diagnostic_only": False} for m in steps],
    }


def test_a_stronger_diagnosis_takes_the_experiments_it_settles_out_of_next_steps() -> None:
    state = TaskState.new(JOB, "t0")
    add_diagnosis(state, _entry("never", ["mismatch_token_clip_max=2", "recompute=old_logprobs"], ["a", "b"]), "t1")
    assert [s["mitigation"] for s in state.next_steps] == ["mismatch_token_clip_max=2", "recompute=old_logprobs"]
    add_diagnosis(state, _entry("never", ["mismatch_token_clip_max=2"], ["a", "b", "c"]), "t2")  # weaker: settles none
    assert len(state.next_steps) == 2
    add_diagnosis(state, _entry("auto", ["mismatch_token_clip_max=2", "ratio_outlier_mask=token"], ["a"]), "t3")
    assert [s["mitigation"] for s in state.next_steps] == ["mismatch_token_clip_max=2", "ratio_outlier_mask=token"]
    assert state.observations[-1]["text"] == (
        "diagnose (iteration 21, model evidence auto) no longer suggests `recompute=old_logprobs`, which an earlier "
        "diagnosis of this snapshot with less evidence did: left out of Next steps"
    )
