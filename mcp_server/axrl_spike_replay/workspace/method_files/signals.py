"""The key signals of a method file, from what the investigation already recorded: nothing is recomputed.

Sources, each read from a file the replays or the task wrote (a few small JSON documents, no tensor):

- the attempt's `replay_result.json`: the recorded spike (grad norm, median, ratio, iteration, world size) and,
  for a mitigated replay, the samples its clean gradient left out (the top-attributed ones and their share);
- the baseline replay's `replay_result.json`: its figures, its consistency verdict and named problems, and its
  largest parameter grad norms;
- the task's diagnosis of the snapshot (written by `task open --snapshot`): the likely causes with the batch
  signals behind them;
- an `attribution.json` of the snapshot without mitigations: the attempt's run dir (or its sweep's), else the
  newest in the job's runs.

A figure none of them holds is named as not measured, with the command that measures it: `method add` runs no
batch analysis and no attribution replay of its own (those cost seconds to hours on a real snapshot).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.figure_names import ATTRIBUTION_SAMPLE, with_current_names
from axrl_spike_replay.experiment.result import ATTRIBUTION_FILE, ReplayResult
from axrl_spike_replay.workspace.paths import job_tmp_dir
from axrl_spike_replay.workspace.task_record.evidence import Baseline
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.task import TaskState

MAX_LINES = 12
MAX_PROBLEMS = 3  # named consistency problems quoted; the rest are counted


def recorded_signals(
    root: Path,
    state: TaskState,
    row: ExperimentRow,
    result: ReplayResult,
    baseline: Baseline,
    top: int = 3,
) -> dict[str, list[str]]:
    """`{"lines": [...], "notes": [...]}` for the method file of the attempt `row` (its replay result `result`, its
    baseline as `evidence.baseline_for` gives it); notes name what was not measured or could not be read."""
    lines = [_spike_line(result)]
    notes: list[str] = []
    if not Path(result.snapshot).is_dir():  # released or rotated: the figures still stand, as recorded
        notes.append(f"snapshot {result.snapshot} is no longer there; the figures here are those recorded while it was")
    lines += _baseline_lines(baseline, notes)
    lines += _diagnosis_lines(state, result, notes)
    lines += _attribution_lines(root, state.job, row, result, top, notes)
    return {"lines": lines[:MAX_LINES], "notes": notes}


def _spike_line(result: ReplayResult) -> str:
    recorded, median = result.recorded_grad_norm, result.median_norm
    ratio = recorded / median if recorded is not None and median else None
    return (
        f"spike: recorded grad norm {_short(recorded)}, {_short(ratio)}x the median {_short(median)} "
        f"(iteration {result.iteration}, world size {result.world_size_saved})"
    )


def _baseline_lines(baseline: Baseline, notes: list[str]) -> list[str]:
    """The baseline replay's figures, its consistency verdict and named problems, its largest parameter grads."""
    if baseline.id is None:
        notes.append(
            "baseline replay: none logged for this snapshot at this layout, so its consistency (the snapshot against "
            "itself, its replay and the training log) was not checked here; `replay SNAPSHOT` checks it"
        )
        return []
    line = (
        f"baseline replay {baseline.id}: grad norm {_short(baseline.grad_norm)}, rel diff vs recorded "
        f"{_short(baseline.rel_diff)} -> {baseline.verdict}"
    )
    consistency = baseline.consistency
    lines = [line]
    if consistency is None:
        notes.append(f"consistency: baseline replay {baseline.id} recorded no consistency checks")
    else:
        lines[0] += f"; {consistency.summary()}"
        problems = consistency.problems
        lines += [f"consistency problem [{p.name}]: {p.message}" for p in problems[:MAX_PROBLEMS]]
        if len(problems) > MAX_PROBLEMS:
            lines.append(f"... and {len(problems) - MAX_PROBLEMS} more consistency problems (see {baseline.id})")
    params = baseline.top_params
    if params:
        cells = ", ".join(f"{p.name} {_short(p.grad_norm)}" for p in params[:3])
        lines.append(f"largest parameter grad norms at the baseline: {cells}")
    return lines


def _diagnosis_lines(state: TaskState, result: ReplayResult, notes: list[str]) -> list[str]:
    """The likely causes of the task's diagnosis of this snapshot, each with its evidence (the batch signals)."""
    entry = diagnosis_of(state, result.snapshot)
    if entry is None:
        notes.append(
            "batch signals: not measured (the task holds no diagnosis of this snapshot); `diagnose SNAPSHOT` "
            "measures them, `task open JOB --snapshot SNAPSHOT` records them in the task"
        )
        return []
    if entry.get("error"):
        notes.append(f"batch signals: the task's diagnosis could not read the snapshot ({entry['error']})")
        return []
    likely = [c for c in entry.get("causes") or [] if isinstance(c, dict) and c.get("likely")]
    lines = []
    for cause in likely[:2]:
        evidence = "; ".join(str(e) for e in (cause.get("evidence") or [])[:3])
        strength = cause.get("strength")
        figure = f", strength {strength:.2f}" if isinstance(strength, (int, float)) else ""
        lines.append(f"diagnosis: {cause.get('title')} ({cause.get('family')}{figure}): {evidence}")
    return lines


def diagnosis_of(state: TaskState, snapshot: str) -> dict[str, Any] | None:
    """The task's latest diagnosis of `snapshot` (paths compared once resolved), None when it holds none."""
    wanted = _real(snapshot)
    found = [d for d in state.diagnoses or [] if isinstance(d, dict) and _real(d.get("snapshot")) == wanted]
    return found[-1] if found else None


def _attribution_lines(
    root: Path, job: str, row: ExperimentRow, result: ReplayResult, top: int, notes: list[str]
) -> list[str]:
    found = find_attribution(root, job, result.snapshot, row.result_path, notes)
    if found is not None:
        path, doc = found
        lines = summarise_attribution(doc, top)
        return [*lines[:-1], f"{lines[-1]} (from {path})"] if lines else []
    clean = result.clean_gradient
    left = [str(s) for s in clean.left_out or []] if clean is not None else []
    if clean is not None and left and isinstance(clean.share_left_out, (int, float)):
        notes.append(
            "per-sample attribution: only the samples carrying the norm were recorded (by this replay's clean "
            "gradient), not their advantages or log-ratios; `attribute SNAPSHOT --job JOB` (MCP `attribute_spike`) "
            "measures them"
        )
        return [
            f"samples carrying the baseline grad norm (this replay's clean-gradient attribution): "
            f"{', '.join(left)} carry {_pct(clean.share_left_out)}"
        ]
    notes.append(
        "per-sample attribution: not measured (no attribution.json of this snapshot in the job's runs); "
        "`attribute SNAPSHOT --job JOB` (MCP `attribute_spike`) measures it"
    )
    return []


def find_attribution(
    root: Path, job: str, snapshot: str, result_path: str | None, notes: list[str]
) -> tuple[Path, dict[str, Any]] | None:
    """An `attribution.json` of the attempt's snapshot without mitigations (an attribution under mitigations
    describes another gradient): the attempt's run dir or its sweep's first, then the job's runs, newest first."""
    from axrl_spike_replay.snapshot.metadata import read_json_document

    candidates: list[Path] = []
    if result_path:
        run = Path(result_path).parent
        candidates += [run / ATTRIBUTION_FILE, run.parent / ATTRIBUTION_FILE]
    runs = job_tmp_dir(root, job)
    if runs.is_dir():
        candidates += sorted(runs.glob(f"*/{ATTRIBUTION_FILE}"), reverse=True)  # run dirs are named by time
    wanted = _real(snapshot)
    seen: set[Path] = set()
    for path in candidates:
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            doc = read_json_document(path)
        except AxrlError as exc:
            notes.append(f"attribution: {exc}; not used")
            continue
        if _real(doc.get("snapshot")) == wanted and not doc.get("mitigations") and isinstance(doc.get("samples"), list):
            return path, doc
    return None


def _real(path: Any) -> str | None:
    return os.path.realpath(path) if isinstance(path, str) and path else None


def summarise_attribution(doc: dict[str, Any], top: int) -> list[str]:
    """The samples that carry the replayed grad norm, with their advantage and importance-ratio signals."""
    samples = doc.get("samples") or []
    base = doc.get("log_ratio_base") or "old"
    if not samples:
        return summarise("attribution", doc, top)
    rows = [with_current_names(s, ATTRIBUTION_SAMPLE) for s in samples[:top] if isinstance(s, dict)]
    cells = [
        f"rank {s.get('rank')} sample {s.get('sample')}: {_pct(s.get('share'))} "
        f"(advantage {_short(s.get('advantage'))}, max |log(pi/pi_{base})| "
        f"{_short(s.get('max_abs_log_ratio_current_vs_base'))})"
        for s in rows
    ]
    lines = [f"samples carrying the grad norm (of {doc.get('total_samples')}): " + "; ".join(cells)]
    lines.append(
        f"attribution: replayed grad norm {_short(doc.get('grad_norm'))} ({doc.get('fidelity')}), "
        f"router term {_short(doc.get('router_term'))}, sum check rel error {_short(doc.get('sum_rel_error'))}"
    )
    return lines


def _pct(value: Any) -> str:
    return f"{value * 100:.1f}%" if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def summarise(kind: str, doc: Any, top: int) -> list[str]:
    """A few readable lines from an analysis document: its scalar facts, then the head of each ranked list."""
    if not isinstance(doc, dict):
        return [f"{kind}: {_short(doc)}"]
    lines: list[str] = []
    summary = doc.get("summary") if isinstance(doc.get("summary"), dict) else None
    scalars = [(k, v) for k, v in (summary or doc).items() if _is_scalar(v) and k not in _SKIP]
    if scalars:
        lines.append(f"{kind}: " + ", ".join(f"{k}={_short(v)}" for k, v in scalars[:6]))
    for key, value in doc.items():
        if key in _SKIP or not isinstance(value, list) or not value:
            continue
        head = ", ".join(_entry(item) for item in value[:top])
        lines.append(f"{kind} {key} (top {min(top, len(value))}): {head}")
    return lines


_SKIP = {"snapshot", "path", "snapshot_dir", "created_at", "format_version", "notes", "warnings"}


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) and not (isinstance(value, str) and len(value) > 60)


def _entry(item: Any) -> str:
    if isinstance(item, dict):
        scalars = [(k, v) for k, v in item.items() if _is_scalar(v)]
        return "(" + ", ".join(f"{k}={_short(v)}" for k, v in scalars[:4]) + ")"
    return _short(item)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
