"""The investigation's final report, rendered from the task state; optionally releases preserved copies after.

Only the preserved copies this investigation uses are released (see `workspace.task_record.preserved_copies`).
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from axrl_spike_replay.experiment.mitigation.trainer_settings import SETTING_KINDS, TRAINERS
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.workspace.method_files.methods import RANKING, method_files, rank_key
from axrl_spike_replay.workspace.method_files.released_methods import follow_released_copies
from axrl_spike_replay.workspace.paths import check_workspace, job_tmp_dir
from axrl_spike_replay.workspace.render import render
from axrl_spike_replay.workspace.task_record.evidence import baseline_rows, output_dir_of, with_runs
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.preserved_copies import (
    copies_in_use,
    copies_kept,
    is_last_copy,
    release_copies,
    source_of,
)
from axrl_spike_replay.workspace.task_record.task import TaskState
from axrl_spike_replay.workspace.task_record.task_diagnosis import open_steps, report_diagnosis
from axrl_spike_replay.workspace.task_record.task_state import (
    now,
    read_state,
    set_task_snapshot,
    update_task,
    used_by_other_tasks,
    write_file,
)
from axrl_spike_replay.workspace.task_record.views import ReportResult
from axrl_spike_replay.workspace.trainer_advice import trainer_advice

REPORT_NAME = "report.md"


def report_context(workspace: Path, state: TaskState) -> dict[str, Any]:
    """Everything the report shows, as plain data for its template (and, with the file, `ReportResult`)."""
    snapshot = state.snapshot
    experiments = state.experiments
    baselines = baseline_rows(state)
    attempts = [row for row in experiments if not row.is_baseline and not row.hypothesis]
    by_slug = {m["slug"]: m for m in method_files(workspace)}
    methods = sorted(
        (
            {**entry, **by_slug.get(entry["slug"], {"path": None, "summary": "(file removed)"})}
            for entry in state.methods
        ),
        key=rank_key,
    )
    in_use = [{**copy, "last_copy": is_last_copy(copy), "in_use": True} for copy in copies_in_use(state)]
    kept = copies_kept(state, in_use, workspace)
    return {
        "job": state.job,
        "ws": f" --workspace {shlex.quote(str(workspace))}",  # in the commands it prints: they run from anywhere
        "generated_at": now(),
        "snapshot": snapshot,
        "snapshot_exists": bool(snapshot) and Path(str(snapshot)).is_dir(),
        "output_dir": output_dir_of(snapshot) or _first_output_dir(experiments),
        "snapshot_history": state.snapshot_history,
        "command": state.command,
        "diagnosis": report_diagnosis(state),
        "fidelity": fidelity_by_target(experiments),
        # each with the consistency its replay recorded: the task-open diagnosis is not the only verdict on it
        "baselines": with_runs(baselines, attempts),
        "same_baseline_norm": len({row.to_json().get("grad_norm") for row in baselines}) == 1,
        "attempt_baselines": [] if baselines else attempt_baselines(experiments),
        "attempts": [row.to_json() for row in attempts],
        "hypotheses": [row.to_json() for row in experiments if row.hypothesis],
        "failed": state.failed,
        "methods": methods,
        "ranking": RANKING,
        "trainer": trainer_advice(methods, snapshot),
        "trainers": TRAINERS,
        "setting_kinds": SETTING_KINDS,
        "observations": state.observations,
        "next_steps": open_steps(state),
        # every copy the task's snapshots have; only those in use (its current snapshot's) are released
        "preserved": [*in_use, *({**copy, "in_use": False} for copy in kept)],
        "preserved_kept": kept,
        "counts": {"experiments": len(experiments), "failed": len(state.failed), "methods": len(methods)},
    }


def attempt_baselines(experiments: list[ExperimentRow]) -> list[dict[str, Any]]:
    """Baselines computed alongside mitigated replays (when no baseline replay was logged on its own), as JSON."""
    out = []
    for row in experiments:
        base, recorded, median = row.baseline_grad_norm, row.recorded_grad_norm, row.median_norm
        if row.is_baseline or row.hypothesis or not _finite(base):
            continue
        assert base is not None
        rel = abs(base - recorded) / recorded if _finite(recorded) and recorded else None
        ratio = base / median if _finite(median) and median else None
        out.append({**row.to_json(), "grad_norm": base, "rel_diff": rel, "ratio_to_median": ratio, "verdict": "n/a"})
    return out


def _finite(value: float | None) -> bool:
    """A number as plain JSON holds one (a figure an earlier version spelled "inf" or "nan" is none)."""
    return value is not None and math.isfinite(value)


def fidelity_by_target(experiments: list[ExperimentRow]) -> list[dict[str, Any]]:
    """Per target and backend: was a full-fidelity replay possible there, and at which world sizes did it run."""
    groups: dict[tuple[str | None, str | None], dict[str, Any]] = {}
    for row in experiments:
        if row.verdict == "failed":
            continue
        entry = groups.setdefault(
            (row.target, row.backend),
            {"target": row.target, "backend": row.backend, "full": False, "world_sizes": set(), "device": None},
        )
        entry["full"] = entry["full"] or row.fidelity == "full"
        entry["world_sizes"].add((row.world_size_used, row.world_size_saved))
        entry["device"] = entry["device"] or row.device
    out = []
    for entry in groups.values():
        sizes = sorted(entry.pop("world_sizes"), key=str)
        entry["world_sizes"] = [{"used": used, "saved": saved} for used, saved in sizes]
        out.append(entry)
    return out


def write_report(
    workspace: str | Path, job: str, release: bool = False, release_last_copy: bool = False
) -> ReportResult:
    """Render `tmp/spike-replay/<job>/report.md` atomically; with `release`, then release the preserved copies
    this investigation uses (those of its current snapshot). A copy that is the last one of its snapshot (the
    rotating `iter_<N>` gone) is kept unless `release_last_copy`.

    The report is written before anything is released (it stays if the release fails half-way), then written again
    from the task as the release left it: its snapshot and replay command then name the rotating `iter_<N>` the
    released copy was made from, and it says what was released, so no command in it points at a deleted copy; the
    method files replayed from that copy are pointed there too (`released_methods`)."""
    root = check_workspace(workspace)
    state = read_state(root, check_plain_name(job, "job name"))
    context = _context(root, state, release, release_last_copy, [])
    path = write_file(job_tmp_dir(root, job) / REPORT_NAME, context["text"], "report")
    preserved = [
        {k: v for k, v in copy.items() if k not in ("last_copy", "in_use")}
        for copy in context["preserved"]
        if copy["in_use"]
    ]
    released = release_copies(preserved, release_last_copy, used_by_other_tasks(root, job)) if release else []

    def change(current: TaskState) -> None:
        current.reports.append({"time": context["generated_at"], "path": str(path), "released": released})
        follow_released_snapshot(current, released)

    after, _ = update_task(root, job, change)
    follow_released_copies(root, released, context["generated_at"])  # method files name what still exists
    if any(entry.get("released") for entry in released):
        context = _context(root, after, release, release_last_copy, released, context["generated_at"])
        write_file(path, context["text"], "report")
    return ReportResult(
        job=context["job"],
        generated_at=context["generated_at"],
        snapshot=context["snapshot"],
        output_dir=context["output_dir"],
        snapshot_history=context["snapshot_history"],
        command=context["command"],
        diagnosis=context["diagnosis"],
        trainer=context["trainer"],
        fidelity=context["fidelity"],
        baselines=context["baselines"],
        attempt_baselines=context["attempt_baselines"],
        attempts=context["attempts"],
        hypotheses=context["hypotheses"],
        failed=context["failed"],
        methods=context["methods"],
        observations=context["observations"],
        next_steps=context["next_steps"],
        preserved=context["preserved"],
        preserved_kept=context["preserved_kept"],
        counts=context["counts"],
        release_requested=release,
        release_last_copy=release_last_copy,
        path=str(path),
        released=released,
        text=context["text"],
    )


def task_diagnosis(workspace: str | Path, job: str) -> dict[str, Any] | None:
    """The diagnosis the report would show for the task of `job` (see `task_diagnosis.report_diagnosis`)."""
    return report_diagnosis(read_state(check_workspace(workspace), check_plain_name(job, "job name")))


def _context(
    root: Path,
    state: TaskState,
    release: bool,
    release_last_copy: bool,
    released: list[dict[str, Any]],
    generated_at: str | None = None,
) -> dict[str, Any]:
    """The report's context and its rendered `text`; `released`: what the release did (empty before it ran)."""
    context = report_context(root, state)
    context["generated_at"] = generated_at or context["generated_at"]
    context["release_requested"] = release
    context["release_last_copy"] = release_last_copy
    context["release_outcomes"] = [
        {**entry, "source": str(source_of(entry)), "source_exists": source_of(entry).is_dir()} for entry in released
    ]
    context["text"] = render("report.md.j2", r=context)
    return context


def follow_released_snapshot(state: TaskState, released: list[dict[str, Any]]) -> None:
    """After the task's own preserved copy is released, point its snapshot and replay command at the rotating
    `iter_<N>` it was copied from, when that still exists (so the task never names a deleted directory)."""
    for entry in released:
        if not entry.get("released") or entry.get("path") != state.snapshot:
            continue
        source = source_of(entry)
        if not source.is_dir():
            continue
        old = str(entry["path"])
        set_task_snapshot(state, source)
        if isinstance(state.command, str):
            state.command = state.command.replace(old, str(state.snapshot))


def _first_output_dir(experiments: list[ExperimentRow]) -> str | None:
    for row in experiments:
        found = output_dir_of(row.snapshot)
        if found:
            return found
    return None
