"""The evidence behind a method or report: an attempt's replay result and the baseline it is compared with."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.result import ParamNorm, ReplayResult
from axrl_spike_replay.snapshot.consistency import Consistency
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, SNAPSHOTS_DIR, parse_iteration
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.task import TaskState


def find_attempt(state: TaskState, attempt_id: str) -> ExperimentRow:
    """The experiment row `attempt_id` (case-insensitive); AxrlError naming the known ids otherwise."""
    wanted = str(attempt_id).strip().upper()
    for row in state.experiments:
        if row.id.upper() == wanted:
            return row
    for failed in state.failed:
        if failed["id"].upper() == wanted:
            raise AxrlError(
                f"attempt {failed['id']} of job {state.job!r} failed ({failed['reason']}); nothing to write up"
            )
    known = ", ".join(row.id for row in state.experiments) or "none yet"
    raise AxrlError(f"unknown attempt id {attempt_id!r} for job {state.job!r} (experiments: {known})")


def result_doc(row: ExperimentRow) -> tuple[ReplayResult, str | None]:
    """The attempt's `replay_result.json`, or (with a note saying so) the figures kept in its task row."""
    path = Path(row.result_path) if row.result_path else None
    if path is not None and path.is_file():
        try:
            return ReplayResult.from_json(json.loads(path.read_text(encoding="utf-8"))), None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, AxrlError) as exc:
            raise AxrlError(f"replay result {path} of attempt {row.id} is unreadable: {exc}") from exc
    note = f"replay_result.json of {row.id} is no longer at {path}; figures are those logged in the task"
    return row_result(row), note


def row_result(row: ExperimentRow) -> ReplayResult:
    """A ReplayResult rebuilt from a task's experiment row; AxrlError naming the row when it lacks what every
    result has (snapshot, backend, target, fidelity, verdict)."""
    missing = [key for key in ("snapshot", "backend", "target", "fidelity", "verdict") if getattr(row, key) is None]
    if missing:
        raise AxrlError(f"experiment row {row.id} has no {', '.join(missing)}; its replay cannot be rebuilt")
    assert row.snapshot is not None and row.backend is not None and row.target is not None
    assert row.fidelity is not None and row.verdict is not None
    return ReplayResult(
        snapshot=row.snapshot,
        backend=row.backend,  # pyright: ignore[reportArgumentType]  # parsed into a Backend by the result
        target=row.target,
        fidelity=row.fidelity,  # pyright: ignore[reportArgumentType]
        world_size_saved=_or(row.world_size_saved, 0),
        world_size_used=_or(row.world_size_used, 0),
        mitigations=row.mitigations or {},
        grad_norm=_num(row.grad_norm),
        recorded_grad_norm=_num(row.recorded_grad_norm),
        rel_diff=_num(row.rel_diff),
        median_norm=_num(row.median_norm),
        spike_ratio=_num(row.ratio_to_median),
        verdict=row.verdict,  # pyright: ignore[reportArgumentType]
        threshold=_num(row.threshold),
        baseline_grad_norm=_num(row.baseline_grad_norm),
        change_vs_baseline=_num(row.change_vs_baseline),
        device=_or(row.device, "cpu"),
        job_name=_or(row.job_name, ""),
        role=_or(row.role, ""),
        iteration=_or(row.iteration, -1),
        config_id=_or(row.config_id, ""),
        patch_sha256=row.patch_sha256,
        node=row.node,
    )


def recorded_consistency(row: ExperimentRow) -> dict[str, Any] | None:
    """The consistency checks a replay recorded in its `replay_result.json` (the snapshot against itself, its
    replay and the training log), as the report shows them: `summary`, `self_consistent`, `agrees_with_log`,
    `problems` [{name, message}]; `note` instead when the file is unreadable; None when it records none."""
    try:
        result, _ = result_doc(row)
    except AxrlError as exc:
        return {"summary": None, "note": str(exc), "problems": []}
    found = result.consistency
    if found is None:
        return None
    return {
        "summary": found.summary(),
        "self_consistent": found.self_consistent,
        "agrees_with_log": found.agrees_with_log,
        "problems": [{"name": p.name, "message": p.message} for p in found.problems],
        "note": None,
    }


def baseline_rows(state: TaskState) -> list[ExperimentRow]:
    """Experiments that changed nothing (no mitigation, no patch) and ran."""
    return [row for row in state.experiments if row.is_baseline and row.verdict != "failed"]


@dataclass(frozen=True)
class Baseline:
    """The baseline an attempt is compared with: a logged baseline replay (`id` set), or the attempt's own."""

    id: str | None
    grad_norm: float | None
    ratio: float | None
    fidelity: str
    rel_diff: float | None
    world_size_used: int
    verdict: str | None
    consistency: Consistency | None
    change: float | None  # the attempt's grad norm against this one's, as a fraction
    note: str | None
    top_params: list[ParamNorm] = field(default_factory=list[ParamNorm])
    result_path: str | None = None


def baseline_for(state: TaskState, row: ExperimentRow, result: ReplayResult) -> Baseline:
    """The baseline the attempt is compared with: the task's latest baseline replay of the same snapshot and
    layout (same world size, backend, target, in that order of preference), else the attempt's own baseline."""
    same_snapshot = [b for b in baseline_rows(state) if b.snapshot == row.snapshot and b.id != row.id]

    def score(b: ExperimentRow) -> tuple[int, int, int]:
        same_size = b.world_size_used == row.world_size_used
        return (int(same_size), int(b.backend == row.backend), int(b.target == row.target))

    order = {id(b): i for i, b in enumerate(state.experiments)}
    best = max(same_snapshot, key=lambda b: (score(b), order[id(b)])) if same_snapshot else None
    other_layout = best is not None and best.world_size_used != row.world_size_used
    if best is not None and not (other_layout and result.baseline_grad_norm is not None):
        base, _ = result_doc(best)
        grad = base.grad_norm
        return Baseline(
            id=best.id,
            grad_norm=grad,
            ratio=base.spike_ratio,
            fidelity=base.fidelity,
            rel_diff=base.rel_diff,
            world_size_used=base.world_size_used,
            verdict=base.verdict,
            consistency=base.consistency,
            top_params=list(base.top_params),
            result_path=best.result_path,
            change=_change(result.grad_norm, grad),
            note=f"the baseline ran at world size {base.world_size_used}, this attempt at {result.world_size_used}"
            if other_layout
            else None,
        )
    grad = result.baseline_grad_norm
    recorded = result.recorded_grad_norm
    return Baseline(
        id=None,
        grad_norm=grad,
        ratio=grad / result.median_norm if grad is not None and result.median_norm else None,
        fidelity=result.fidelity,
        rel_diff=abs(grad - recorded) / recorded if grad is not None and recorded else None,
        world_size_used=result.world_size_used,
        verdict=None,
        consistency=None,
        change=_change(result.grad_norm, grad),
        note="no baseline replay of this snapshot at this layout in the task; baseline grad norm taken from the "
        "attempt's own replay result",
    )


def output_dir_of(snapshot: str | Path | None) -> str | None:
    """The job's output dir for a snapshot under `checkpoints/spike_snapshots[-active]/iter_<N>`, else None."""
    if not snapshot:
        return None
    path = Path(snapshot)
    if parse_iteration(path.name) is None:
        return None
    for layout_dir in (SNAPSHOTS_DIR, PRESERVED_DIR):
        if path.parent.name == layout_dir.name and path.parent.parent.name == layout_dir.parent.name:
            return str(path.parent.parent.parent)
    return None


def _change(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base - 1


def _num(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _id_number(exp_id: str) -> int:
    digits = "".join(ch for ch in str(exp_id) if ch.isdigit())
    return int(digits) if digits else 0


def with_runs(baselines: list[ExperimentRow], attempts: list[ExperimentRow]) -> list[dict[str, Any]]:
    """Baseline rows (as JSON) with the consistency each replay recorded (`recorded_consistency`), the verb that
    ran each (`run`: replay, sweep, ...) and the attempts judged against it (`judges`): those logged with it as their
    `baseline` (a later sweep that replayed the same baseline reuses the row), and those of the same sweep (a sweep's
    rows share its run dir, `<ts>/baseline/`, `<ts>/<config_id>/`, and its command line)."""
    out = []
    for row in baselines:
        command = row.command
        words = str(command or "").split()
        run = words[1] if len(words) > 1 and words[0].endswith("axrl-spike-replay") else None
        path = Path(row.result_path) if row.result_path else None
        judges = []
        if path is not None and path.parent.name == "baseline" and command:
            judges = [
                a.id
                for a in attempts
                if a.result_path and a.command == command and Path(a.result_path).parent.parent == path.parent.parent
            ]
        judges += [a.id for a in attempts if a.baseline == row.id and a.id not in judges]
        doc = {**row.to_json(), "consistency": recorded_consistency(row)}
        out.append({**doc, "run": run, "judges": sorted(judges, key=_id_number)})
    return out
