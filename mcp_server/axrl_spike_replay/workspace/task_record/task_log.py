"""Logging replays into the job's task, when one is open: one experiment row per config, failures too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.experiment.run_dir import BASELINE_COMMAND_FILE
from axrl_spike_replay.experiment.verdict import basis_field
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.vocabulary import Verdict
from axrl_spike_replay.workspace.paths import in_workspace
from axrl_spike_replay.workspace.task_record.changes import describe_change, is_baseline, normalise_config
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.preserved_copies import note_preserved_copy
from axrl_spike_replay.workspace.task_record.task import TaskState
from axrl_spike_replay.workspace.task_record.task_diagnosis import add_diagnosis
from axrl_spike_replay.workspace.task_record.task_state import now, task_exists, update_task


def experiment_row(
    exp_id: str, result: ReplayResult, result_path: Path | str | None, command: str | None = None
) -> ExperimentRow:
    """The experiment table's row for one replay result (as plain JSON holds it: a non-finite figure is null) and
    the command that reruns it."""
    ratio = result.spike_ratio
    if ratio is None and result.grad_norm is not None and result.median_norm:
        ratio = result.grad_norm / result.median_norm
    row = {
        "id": exp_id,
        "time": now(),
        "snapshot": result.snapshot,
        "backend": result.backend,
        "target": result.target,
        "fidelity": result.fidelity,
        "mitigations": normalise_config(result.mitigations),
        "patch_sha256": result.patch_sha256,
        "change": describe_change(result.mitigations, result.patch_sha256, result.hypothesis),
        "is_baseline": is_baseline(result.mitigations, result.patch_sha256, result.hypothesis),
        # a hypothesis replay: judged against the recording ("reproduced under `aux_loss_coef=10.24@1`")
        "hypothesis": normalise_config(result.hypothesis),
        "finding": result.finding,
        "rank_losses_match": _rank_losses_match(result),
        "config_id": result.config_id,
        "grad_norm": _float(result.grad_norm),
        "recorded_grad_norm": _float(result.recorded_grad_norm),
        "rel_diff": _float(result.rel_diff),
        "median_norm": _float(result.median_norm),
        "ratio_to_median": _float(ratio),
        "threshold": _float(result.threshold),
        "baseline_grad_norm": _float(result.baseline_grad_norm),
        "change_vs_baseline": _float(result.change_vs_baseline),
        "verdict": result.verdict,
        "world_size_saved": result.world_size_saved,
        "world_size_used": result.world_size_used,
        "device": result.device,
        "job_name": result.job_name,
        "role": result.role,
        "iteration": result.iteration,
        "node": result.node,
        "result_path": str(result_path) if result_path is not None else None,
        "command": command,
    }
    return ExperimentRow.from_json(to_jsonable(row))


def record_replay(workspace: Path | str, job: str, result: ReplayResult, result_path: Path | str) -> str | None:
    """Append one experiment row when a task is open for `job`; its id (`E3`), or None when none is open.

    A result whose verdict is `failed` goes under Failed attempts instead (id `F2`). A baseline that repeats one
    the task holds (`repeated_baseline`: each sweep replays its own) is not logged again: its id is that row's.
    """
    root = _open_root(workspace, job)
    if root is None:
        return None
    if result.verdict == Verdict.FAILED:
        what = describe_change(result.mitigations, result.patch_sha256, result.hypothesis)
        return record_failure(
            root,
            job,
            reason=result.error or "replay failed",
            command=f"{result.backend} replay ({what})",
            snapshot=result.snapshot,
            target=result.target,
            result_path=Path(result_path) if result_path is not None else None,
        )

    command = in_workspace(command_of(result_path), root, job, result.job_name)
    baseline_command = in_workspace(baseline_command_of(result_path), root, job, result.job_name)

    def change(state: TaskState) -> str:
        repeated = repeated_baseline(state, result)
        if repeated is not None:
            return repeated
        exp_id = f"E{len(state.experiments) + 1}"
        # each row keeps its own command (a sweep's baseline: the baseline's, not the sweep's); the task's replay
        # command is the baseline's (what reproduces the step), unless one was set by hand
        changed = not is_baseline(result.mitigations, result.patch_sha256, result.hypothesis)
        own = command if changed else (baseline_command or command)
        row = experiment_row(exp_id, result, result_path, own)
        row.baseline = baseline_row_of(state, row)
        state.experiments.append(row)
        if not state.snapshot:
            state.snapshot = result.snapshot
            state.snapshot_history.append({"time": now(), "snapshot": result.snapshot})
        shown = row.command if row.is_baseline else baseline_command
        # the task's command replays its active snapshot: a replay of another iteration (checked beside it) keeps it
        if shown and state.command_source != "user" and result.snapshot == state.snapshot:
            state.command = shown
            state.command_source = "replay"
        if result.snapshot == state.snapshot:
            note_preserved_copy(state, result.snapshot, now())
        return exp_id

    _, exp_id = update_task(root, job, change)
    return exp_id


def repeated_baseline(state: TaskState, result: ReplayResult) -> str | None:
    """The id of the logged baseline `result` repeats: the same snapshot, replayed the same way (backend, target,
    device, fidelity, world size) to the same grad norm; None when it is new (or not a baseline: a hypothesis replay
    that leaves the grad norm as it was is an attempt of its own, logged with its finding)."""
    if not is_baseline(result.mitigations, result.patch_sha256, result.hypothesis) or result.grad_norm is None:
        return None
    row = experiment_row("", result, None)
    for logged in state.experiments:
        if logged.is_baseline and _same_replay(logged, row) and logged.grad_norm == row.grad_norm:
            return logged.id
    return None


def _same_replay(a: ExperimentRow, b: ExperimentRow) -> bool:
    """The same snapshot replayed the same way: backend, target, device, fidelity and world size."""
    return (a.snapshot, a.backend, a.target, a.device, a.fidelity, a.world_size_used) == (
        b.snapshot,
        b.backend,
        b.target,
        b.device,
        b.fidelity,
        b.world_size_used,
    )


def baseline_row_of(state: TaskState, row: ExperimentRow) -> str | None:
    """The id of the logged baseline a mitigated row was judged against: the same snapshot and way of replaying,
    the grad norm its run's baseline had (None for a baseline, or when none is logged)."""
    if row.is_baseline or row.baseline_grad_norm is None:
        return None
    for logged in reversed(state.experiments):
        if logged.is_baseline and logged.grad_norm == row.baseline_grad_norm and _same_replay(logged, row):
            return logged.id
    return None


def record_failure(
    workspace: Path | str,
    job: str,
    *,
    reason: str,
    command: str,
    snapshot: str,
    target: str = "local",
    result_path: Path | str | None = None,
) -> str | None:
    """Append a Failed attempts entry when a task is open for `job`; its id (`F2`), or None when none is open."""
    root = _open_root(workspace, job)
    if root is None:
        return None

    def change(state: TaskState) -> str:
        fail_id = f"F{len(state.failed) + 1}"
        state.failed.append(
            {
                "id": fail_id,
                "time": now(),
                "snapshot": str(snapshot),
                "target": target,
                "command": command,
                "reason": reason,
                "result_path": str(result_path) if result_path is not None else None,
            }
        )
        return fail_id

    _, fail_id = update_task(root, job, change)
    return fail_id


def command_of(result_path: Path | str | None) -> str | None:
    """The command line recorded beside a replay result (`command.txt` in its run dir; a sweep's one level up)."""
    return _recorded_line(result_path, "command.txt")


def baseline_command_of(result_path: Path | str | None) -> str | None:
    """The baseline's command line a run recorded beside a mitigated or hypothesis replay (`baseline_command.txt`
    in its run dir; a sweep's one level up): the same replay without its configs. None when none was recorded."""
    return _recorded_line(result_path, BASELINE_COMMAND_FILE)


def _recorded_line(result_path: Path | str | None, name: str) -> str | None:
    """The text of file `name` in a result's run dir, or one level up (a sweep's), cut to 4,000 characters."""
    if result_path is None:
        return None
    folder = Path(result_path).parent
    for candidate in (folder / name, folder.parent / name):
        try:
            if candidate.is_file():
                text = candidate.read_text(encoding="utf-8", errors="replace").strip()
                return text[:4000] or None
        except OSError:
            continue
    return None


def _rank_losses_match(result: ReplayResult) -> bool | None:
    """A hypothesis replay: whether every recorded rank loss matched the replayed one (None: none compared)."""
    rows = basis_field(result.verdict_basis, "rank_losses") or []
    judged = [row.get("matches") for row in rows if isinstance(row, dict) and row.get("matches") is not None]
    return all(judged) if judged else None


def record_diagnosis(workspace: Path | str, job: str, entry: dict[str, Any]) -> bool:
    """Keep a diagnosis run (an entry of `diagnosis.task_entry`) in the task of `job` when one is open: its causes
    under Observations, its experiments not listed yet under Next steps; the report shows the strongest diagnosis of
    the task's snapshot. False when no task is open for `job`."""
    root = _open_root(workspace, job)
    if root is None:
        return False
    update_task(root, job, lambda state: add_diagnosis(state, entry, now()))
    return True


def _open_root(workspace: Path | str, job: str) -> Path | None:
    root = Path(workspace).expanduser()
    if not root.is_dir():
        return None
    try:
        check_plain_name(job, "job name")
    except AxrlError:
        return None
    return root.resolve() if task_exists(root, job) else None


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)  # the row goes through to_jsonable: non-finite -> null
