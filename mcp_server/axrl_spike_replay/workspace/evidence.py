"""The evidence behind a method or report: an attempt's replay result and the baseline it is compared with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.snapshot.consistency import consistency_line
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, SNAPSHOTS_DIR, parse_iteration
from axrl_spike_replay.workspace.task import TaskState


def find_attempt(state: TaskState, attempt_id: str) -> dict[str, Any]:
    """The experiment row `attempt_id` (case-insensitive); AxrlError naming the known ids otherwise."""
    wanted = str(attempt_id).strip().upper()
    for row in state.experiments:
        if row["id"].upper() == wanted:
            return row
    for failed in state.failed:
        if failed["id"].upper() == wanted:
            raise AxrlError(
                f"attempt {failed['id']} of job {state.job!r} failed ({failed['reason']}); nothing to write up"
            )
    known = ", ".join(row["id"] for row in state.experiments) or "none yet"
    raise AxrlError(f"unknown attempt id {attempt_id!r} for job {state.job!r} (experiments: {known})")


def result_doc(row: dict[str, Any]) -> tuple[ReplayResult, str | None]:
    """The attempt's `replay_result.json`, or (with a note saying so) the figures kept in its task row."""
    path = Path(row["result_path"]) if row.get("result_path") else None
    if path is not None and path.is_file():
        try:
            return ReplayResult.from_json(json.loads(path.read_text(encoding="utf-8"))), None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, AxrlError) as exc:
            raise AxrlError(f"replay result {path} of attempt {row['id']} is unreadable: {exc}") from exc
    note = f"replay_result.json of {row['id']} is no longer at {path}; figures are those logged in the task"
    return row_result(row), note


def row_result(row: dict[str, Any]) -> ReplayResult:
    """A ReplayResult rebuilt from a task's experiment row."""
    return ReplayResult(
        snapshot=row["snapshot"],
        backend=row["backend"],
        target=row["target"],
        fidelity=row["fidelity"],
        world_size_saved=row.get("world_size_saved", 0),
        world_size_used=row.get("world_size_used", 0),
        mitigations=row.get("mitigations") or {},
        grad_norm=_num(row.get("grad_norm")),
        recorded_grad_norm=_num(row.get("recorded_grad_norm")),
        rel_diff=_num(row.get("rel_diff")),
        median_norm=_num(row.get("median_norm")),
        spike_ratio=_num(row.get("ratio_to_median")),
        verdict=row["verdict"],
        threshold=_num(row.get("threshold")),
        baseline_grad_norm=_num(row.get("baseline_grad_norm")),
        change_vs_baseline=_num(row.get("change_vs_baseline")),
        device=row.get("device", "cpu"),
        job_name=row.get("job_name", ""),
        role=row.get("role", ""),
        iteration=row.get("iteration", -1),
        config_id=row.get("config_id", ""),
        patch_sha256=row.get("patch_sha256"),
        node=row.get("node"),
    )


def recorded_consistency(row: dict[str, Any]) -> dict[str, Any] | None:
    """The consistency checks a replay recorded in its `replay_result.json` (the snapshot against itself, its
    replay and the training log), as the report shows them: `summary`, `self_consistent`, `agrees_with_log`,
    `problems` [{name, message}]; `note` instead when the file is unreadable; None when it records none."""
    try:
        result, _ = result_doc(row)
    except AxrlError as exc:
        return {"summary": None, "note": str(exc), "problems": []}
    doc = result.consistency
    if not isinstance(doc, dict):
        return None
    problems = [p for p in doc.get("problems") or [] if isinstance(p, dict)]
    return {
        "summary": consistency_line(doc),
        "self_consistent": doc.get("self_consistent"),
        "agrees_with_log": doc.get("agrees_with_log"),
        "problems": [{"name": str(p.get("name")), "message": str(p.get("message"))} for p in problems],
        "note": None,
    }


def baseline_rows(state: TaskState) -> list[dict[str, Any]]:
    """Experiments that changed nothing (no mitigation, no patch) and ran."""
    return [row for row in state.experiments if row.get("is_baseline") and row["verdict"] != "failed"]


def baseline_for(state: TaskState, row: dict[str, Any], result: ReplayResult) -> dict[str, Any]:
    """The baseline the attempt is compared with: the task's latest baseline replay of the same snapshot and
    layout (same world size, backend, target, in that order of preference), else the attempt's own baseline."""
    same_snapshot = [b for b in baseline_rows(state) if b["snapshot"] == row["snapshot"] and b["id"] != row["id"]]

    def score(b: dict[str, Any]) -> tuple[int, int, int]:
        return (
            int(b.get("world_size_used") == row.get("world_size_used")),
            int(b["backend"] == row["backend"]),
            int(b["target"] == row["target"]),
        )

    best = max(same_snapshot, key=lambda b: (score(b), state.experiments.index(b))) if same_snapshot else None
    other_layout = best is not None and best.get("world_size_used") != row.get("world_size_used")
    if best is not None and not (other_layout and result.baseline_grad_norm is not None):
        base, _ = result_doc(best)
        grad = base.grad_norm
        return {
            "id": best["id"],
            "grad_norm": grad,
            "ratio": base.spike_ratio,
            "fidelity": base.fidelity,
            "rel_diff": base.rel_diff,
            "world_size_used": base.world_size_used,
            "verdict": base.verdict,
            "consistency": base.consistency,
            "top_params": base.top_params,
            "result_path": best.get("result_path"),
            "change": _change(result.grad_norm, grad),
            "note": f"the baseline ran at world size {base.world_size_used}, this attempt at {result.world_size_used}"
            if other_layout
            else None,
        }
    grad = result.baseline_grad_norm
    recorded = result.recorded_grad_norm
    return {
        "id": None,
        "grad_norm": grad,
        "ratio": grad / result.median_norm if grad is not None and result.median_norm else None,
        "fidelity": result.fidelity,
        "rel_diff": abs(grad - recorded) / recorded if grad is not None and recorded else None,
        "world_size_used": result.world_size_used,
        "verdict": None,
        "consistency": None,
        "top_params": [],
        "result_path": None,
        "change": _change(result.grad_norm, grad),
        "note": "no baseline replay of this snapshot at this layout in the task; baseline grad norm taken from the "
        "attempt's own replay result",
    }


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


def with_runs(baselines: list[dict[str, Any]], attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Baseline rows with the verb that ran each (`run`: replay, sweep, ...) and the attempts of the same sweep,
    which are judged against it (`judges`): each run replays its own baseline, so each adds a row. A sweep's rows
    share its run dir (`<ts>/baseline/`, `<ts>/<config_id>/`) and its command line."""
    out = []
    for row in baselines:
        command = row.get("command")
        words = str(command or "").split()
        run = words[1] if len(words) > 1 and words[0].endswith("axrl-spike-replay") else None
        path = Path(row["result_path"]) if row.get("result_path") else None
        judges = []
        if path is not None and path.parent.name == "baseline" and command:
            judges = [
                a["id"]
                for a in attempts
                if a.get("result_path") and a.get("command") == command and Path(a["result_path"]).parent.parent
                == path.parent.parent
            ]  # fmt: skip
        out.append({**row, "run": run, "judges": judges})
    return out
