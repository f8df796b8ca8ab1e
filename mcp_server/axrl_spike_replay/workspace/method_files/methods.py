"""Method files: one proven (or partial, or diagnostic) mitigation per file, with its evidence, plus an index."""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS, diagnostic_reasons, mitigation_args
from axrl_spike_replay.experiment.mitigation.trainer_changes import trainer_changes
from axrl_spike_replay.experiment.mitigation.trainer_settings import TRAINERS, snapshot_trainer
from axrl_spike_replay.experiment.result import CleanGradient, ReplayResult
from axrl_spike_replay.experiment.verdict import WRITABLE_VERDICTS, basis_field, threshold_label, writable_problem
from axrl_spike_replay.files.locks import held_lock
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.vocabulary import Fidelity, Verdict
from axrl_spike_replay.workspace.method_files import front_matter
from axrl_spike_replay.workspace.method_files.method_names import name_warning
from axrl_spike_replay.workspace.method_files.signals import recorded_signals
from axrl_spike_replay.workspace.paths import METHODS_INDEX, TASKS_DIR, check_workspace, in_workspace, methods_dir
from axrl_spike_replay.workspace.render import fmt, pct, render
from axrl_spike_replay.workspace.task_record.changes import config_key, describe_change, normalise_config
from axrl_spike_replay.workspace.task_record.evidence import (
    Baseline,
    baseline_for,
    find_attempt,
    output_dir_of,
    result_doc,
)
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.preserved_copies import source_of_copy
from axrl_spike_replay.workspace.task_record.task import TaskState
from axrl_spike_replay.workspace.task_record.task_state import now, read_state, update_task, write_file
from axrl_spike_replay.workspace.task_record.views import MethodAdded, MethodEntry

STATUSES = ("proven", "partial", "diagnostic")
SIGNAL_TOP = 3
RELEASED_LATER = "which is released when the investigation ends (`report --release`)"  # `released_methods` edits it
SHIPPED_DIR = "spike-mitigation-methods"  # the methods that ship with the tool (packaged data, or the checkout's)
RANKING = (
    "proven before partial before diagnostic; then the larger cosine to the clean gradient (the healthy gradient "
    "kept most intact); a method whose clean gradient never got under the spike bar (a rough reference) after "
    "those whose did, ranked by footprint alone; then the smaller fraction of loss tokens masked or changed; "
    "methods without these figures (written before they were measured) after those with them"
)


def rank_key(fields: dict[str, Any]) -> tuple[Any, ...]:
    """Sort key of a method's front matter: see RANKING."""
    order = {"proven": 0, "partial": 1, "diagnostic": 2}
    cos, frac = _number(fields.get("cosine_to_clean")), _number(fields.get("token_fraction"))
    rough = cos is not None and fields.get("clean_reached") is False  # files without the field: as before
    return (
        order.get(str(fields.get("status")), 3),
        2 if cos is None else 1 if rough else 0,
        0.0 if rough else -(cos or 0.0),
        frac is None,
        frac or 0.0,
        str(fields.get("slug", "")),
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def shipped_methods_dir() -> Path | None:
    """The shipped methods' folder (inside the wheel, or the source checkout's), None when not installed."""
    from axrl_spike_replay.package_data import data_dir

    try:
        return data_dir(SHIPPED_DIR)
    except FileNotFoundError:
        return None


def method_status(verdict: Verdict, fidelity: Fidelity) -> str:
    """proven (cleared at full fidelity), partial (partial at full fidelity) or diagnostic (reduced fidelity)."""
    if fidelity != Fidelity.FULL:
        return "diagnostic"
    return "proven" if verdict == Verdict.CLEARED else "partial"


def check_slug(name: str) -> str:
    """The method's slug (a trailing `.md` dropped); ConfigError unless it is a plain file name."""
    slug = name[:-3] if isinstance(name, str) and name.endswith(".md") else name
    check_plain_name(slug, "method name")
    if slug.lower() == METHODS_INDEX[:-3].lower():
        raise ConfigError(f"method name {name!r} is reserved for the index; choose another")
    return slug


def add_method(
    workspace: str | Path,
    job: str,
    attempt_id: str,
    name: str,
    rationale: str,
    allow_reduced: bool = False,
    replace: bool = False,
) -> MethodAdded:
    """Write `spike-mitigation-methods/<slug>.md` for a cleared/partial, non-duplicate attempt; regenerate the index.

    `replace` overwrites an existing method file of the same name (regenerating it); a duplicate of another of
    the workspace's methods is still refused. The same change as a shipped method is written (this spike is new
    evidence for it) and marked `confirms_shipped: <slug>`.
    """
    root = check_workspace(workspace)
    slug = check_slug(name)
    if not rationale or not rationale.strip():
        raise ConfigError("rationale is empty; say why this mitigation works")
    state = read_state(root, check_plain_name(job, "job name"))
    first = find_attempt(state, attempt_id)
    result, _ = result_doc(first)
    _check_writable(first.id, result, baseline_for(state, first, result).grad_norm, allow_reduced)
    _check_production(first.id, result)
    _check_not_duplicate(root, slug, result, replace)  # again under the lock; first here, to fail early
    written: list[tuple[dict[str, Any], Path]] = []
    signals: dict[str, list[str]] = {}

    def change(state: TaskState) -> None:
        row = find_attempt(state, attempt_id)
        result, result_note = result_doc(row)
        baseline = baseline_for(state, row, result)
        # from the files the replays and the task wrote (no batch read, no replay): cheap enough under the locks
        signals.update(recorded_signals(root, state, row, result, baseline, top=SIGNAL_TOP))
        with held_lock(root / TASKS_DIR / ".methods.lock", 120, "method files"):
            confirms = _check_not_duplicate(root, slug, result, replace)
            doc = _method_doc(root, state, row, result, result_note, baseline, slug, rationale.strip(), signals)
            if confirms is not None:
                doc["front_matter"]["confirms_shipped"] = confirms
            path = methods_dir(root) / f"{slug}.md"
            write_file(path, front_matter.dump(doc["front_matter"]) + render("method.md.j2", m=doc), "method file")
            write_index(root)
        state.methods = [m for m in state.methods if m["slug"] != slug]
        state.methods.append({"slug": slug, "attempt": row.id, "status": doc["status"], "time": now()})
        written.append((doc["front_matter"], path))

    update_task(root, job, change)
    fields, path = written[-1]
    warning = name_warning(slug, fields["mitigations"] or {}, known_method_names(root))
    return MethodAdded(
        axrl_method=fields[front_matter.MARKER],
        slug=fields["slug"],
        status=fields["status"],
        summary=fields["summary"],
        job=fields["job"],
        job_name=fields["job_name"],
        role=fields["role"],
        iteration=fields["iteration"],
        snapshot=fields["snapshot"],
        attempt=fields["attempt"],
        verdict=fields["verdict"],
        fidelity=fields["fidelity"],
        mitigations=fields["mitigations"],
        config_key=fields["config_key"],
        patch_sha256=fields["patch_sha256"],
        grad_norm=fields["grad_norm"],
        baseline_grad_norm=fields["baseline_grad_norm"],
        spike_ratio=fields["spike_ratio"],
        threshold=fields["threshold"],
        result_path=fields["result_path"],
        created_at=fields["created_at"],
        path=str(path),
        signals=signals,
        confirms_shipped=fields.get("confirms_shipped"),
        cosine_to_clean=fields.get("cosine_to_clean"),
        clean_reached=fields.get("clean_reached"),
        token_fraction=fields.get("token_fraction"),
        sample_fraction=fields.get("sample_fraction"),
        rank=next((m.rank for m in list_methods(root) if Path(m.path) == Path(path)), 0),
        warnings=[warning] if warning else [],
    )


def known_method_names(workspace: Path) -> dict[str, dict[str, Any]]:
    """{slug: normalised config} of the methods whose names people know: the shipped ones and the seed workflow's."""
    from axrl_spike_replay.experiment.mitigation.mitigation_sets import SEED_WORKFLOW_METHODS

    known = {slug: normalise_config(config) for slug, config in SEED_WORKFLOW_METHODS.items()}
    for path, fields in _shipped_front_matters(workspace):
        if isinstance(fields.get("mitigations"), dict):
            known[str(fields.get("slug") or path.stem)] = fields["mitigations"]
    return known


def list_methods(workspace: str | Path) -> list[MethodEntry]:
    """The workspace's method files and the shipped ones (`source` says which), ranked (see RANKING), each with its
    front matter (status `unknown` for files without one). A workspace at the tool's own checkout holds the shipped
    methods themselves: they are listed once, as `shipped`."""
    own = "shipped" if _is_shipped_folder(methods_dir(check_workspace(workspace))) else "workspace"
    found = [(path, fields, own) for path, fields in _front_matters(workspace)]
    found += [(path, fields, "shipped") for path, fields in _shipped_front_matters(workspace)]
    found.sort(key=lambda item: (rank_key(item[1]), item[2]))
    return [
        MethodEntry(
            slug=str(fields.get("slug", path.stem)),
            status=str(fields.get("status", "unknown")),
            summary=None if fields.get("summary") is None else str(fields["summary"]),
            path=str(path),
            front_matter=fields,
            source=source,
            rank=i,
        )
        for i, (path, fields, source) in enumerate(found, start=1)
    ]


def method_files(workspace: str | Path) -> list[dict[str, Any]]:
    """The workspace's method files, ranked (see RANKING), as front matter plus `path` (what the index and the
    report read)."""
    files = [{**fields, "path": str(path)} for path, fields in _front_matters(workspace)]
    return sorted(files, key=rank_key)


def _is_shipped_folder(folder: Path) -> bool:
    """True when `folder` is the shipped methods' folder (a workspace at the tool's own checkout)."""
    shipped = shipped_methods_dir()
    return shipped is not None and shipped.resolve() == folder.resolve()


def _shipped_front_matters(workspace: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """The shipped methods, unless the workspace's own folder is that folder (a workspace at the checkout)."""
    shipped = shipped_methods_dir()
    if shipped is None or _is_shipped_folder(methods_dir(check_workspace(workspace))):
        return []
    return _front_matters_in(shipped)


def _front_matters(workspace: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    return _front_matters_in(methods_dir(check_workspace(workspace)))


def _front_matters_in(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    if not folder.is_dir():
        return []
    methods = []
    for path in sorted(folder.glob("*.md")):
        if path.name == METHODS_INDEX:
            continue
        fields = front_matter.load(path)
        if fields is None:
            fields = {"slug": path.stem, "status": "unknown", "summary": "(no front matter written by this tool)"}
        methods.append((path, fields))
    return methods


def write_index(workspace: Path) -> Path:
    """Regenerate `spike-mitigation-methods/README.md` from the method files."""
    methods = method_files(workspace)
    text = render("methods-index.md.j2", methods=methods)
    return write_file(methods_dir(workspace) / METHODS_INDEX, text, "methods index")


def _check_writable(attempt_id: str, result: ReplayResult, baseline_norm: float | None, allow_reduced: bool) -> None:
    """AxrlError unless the attempt is a cleared/partial mitigation of a baseline that was a spike (and full
    fidelity, unless allowed). The figures are re-checked: the stored verdict alone is not trusted."""
    if result.verdict not in WRITABLE_VERDICTS:
        raise AxrlError(
            f"attempt {attempt_id} has verdict {result.verdict!r}; only a 'cleared' or 'partial' attempt "
            "can be written up as a method"
        )
    base = result.baseline_grad_norm if result.baseline_grad_norm is not None else baseline_norm
    if base is None and basis_field(result.verdict_basis, "baseline_finite") is False:
        base = math.nan  # a NaN or inf baseline, kept as null in the result file: the clearest spike there is
    problem = writable_problem(result.verdict, result.grad_norm, base, result.median_norm, result.threshold)
    if problem is not None:
        raise AxrlError(f"attempt {attempt_id} cannot be written up as a method: {problem}")
    if result.fidelity != Fidelity.FULL and not allow_reduced:
        raise AxrlError(
            f"attempt {attempt_id} ran at {result.fidelity!r} fidelity (world size {result.world_size_used} of "
            f"{result.world_size_saved}); rerun it at full fidelity, or pass `allow_reduced` to write it up as "
            "diagnostic only"
        )


def _check_production(attempt_id: str, result: ReplayResult) -> None:
    """AxrlError when the attempt uses a diagnostic-only mitigation (`drop_samples`): never written up as a fix."""
    reasons = diagnostic_reasons(result.mitigations)
    if reasons:
        raise AxrlError(
            f"attempt {attempt_id} uses a diagnostic-only mitigation, which is never written up as a method: "
            + "; ".join(reasons)
            + ". It shows where the cause is; write up the mitigation that removes it (e.g. advantage_outlier_mask)"
        )


def _check_not_duplicate(root: Path, slug: str, result: ReplayResult, replace: bool) -> str | None:
    """AxrlError when one of the workspace's methods records the same change (or `slug` is taken); else the slug of
    the shipped method recording the same change, if any."""
    target = methods_dir(root) / f"{slug}.md"
    confirms: str | None = None
    key = config_key(result.mitigations)
    shipped = [{**fields, "path": str(path), "_shipped": True} for path, fields in _shipped_front_matters(root)]
    for method in [*method_files(root), *shipped]:
        if replace and method["path"] == str(target):
            continue
        same_patch = bool(result.patch_sha256) and method.get("patch_sha256") == result.patch_sha256
        same_config = not result.patch_sha256 and not method.get("patch_sha256") and method.get("config_key") == key
        if same_patch or same_config:
            sha = result.patch_sha256
            what = f"patch {sha[:12]}" if same_patch and sha else describe_change(result.mitigations)
            if method.get("_shipped"):
                confirms = str(method.get("slug") or Path(method["path"]).stem)
                continue
            raise AxrlError(f"duplicate method: method file {method['path']} already records the same change ({what})")
    if target.exists() and not replace:
        raise AxrlError(f"method file {target} already exists for a different change; choose another name")
    return confirms


def _method_doc(
    workspace: Path,
    state: TaskState,
    row: ExperimentRow,
    result: ReplayResult,
    result_note: str | None,
    baseline: Baseline,
    slug: str,
    rationale: str,
    signals: dict[str, Any],
) -> dict[str, Any]:
    status = method_status(result.verdict, result.fidelity)
    change = describe_change(result.mitigations, result.patch_sha256)
    ratio = result.spike_ratio
    summary = (
        f"{change}: grad norm {fmt(baseline.grad_norm)} -> {fmt(result.grad_norm)} "
        f"({pct(result.change_vs_baseline if result.change_vs_baseline is not None else baseline.change)}), "
        f"ratio to median {fmt(ratio)} vs threshold {fmt(result.threshold)}"
    )
    fields = {
        front_matter.MARKER: 1,
        "slug": slug,
        "status": status,
        "summary": summary,
        "job": state.job,
        "job_name": result.job_name or state.job,
        "role": result.role,
        "iteration": result.iteration,
        "snapshot": result.snapshot,
        "attempt": row.id,
        "verdict": result.verdict,
        "fidelity": result.fidelity,
        "mitigations": normalise_config(result.mitigations),
        "config_key": config_key(result.mitigations),
        "patch_sha256": result.patch_sha256,
        "grad_norm": result.grad_norm,
        "baseline_grad_norm": baseline.grad_norm,
        "spike_ratio": ratio,
        "threshold": result.threshold,
        "cosine_to_clean": result.cosine_to_clean,
        "clean_reached": result.clean_gradient.reached if result.clean_gradient else None,
        "token_fraction": result.footprint.token_fraction if result.footprint else None,
        "sample_fraction": result.footprint.sample_fraction if result.footprint else None,
        "result_path": row.result_path,
        "created_at": now(),
    }
    replay = replay_it(result, workspace, state.job)
    fields["source_snapshot"] = replay["source"]
    trainer = snapshot_trainer(result.snapshot)
    changes = in_your_trainer(result, trainer)
    fields["trainer"] = trainer
    # the change in the trainer that wrote the snapshot (the report quotes it); every trainer's is in the file
    fields["trainer_settings"] = [c["setting"] for c in changes if c["trainer"] == (trainer or "axrl") and c["setting"]]
    return {
        "front_matter": json.loads(json.dumps(fields, default=str)),
        "status": status,
        "change": change,
        "mitigations_json": json.dumps(normalise_config(result.mitigations), indent=2, sort_keys=True),
        "patch": _patch_text(row, result),
        "result": result,
        "result_note": result_note,
        "baseline": baseline,
        "row": row,
        "rationale": rationale,
        "signals": signals,
        "output_dir": output_dir_of(result.snapshot),
        "residual": _residual(result, baseline),
        "threshold_label": threshold_label(result.verdict_basis),
        "summary": summary,
        "mechanism": [f"`{name}`: {MITIGATIONS[name].doc}" for name in result.mitigations if name in MITIGATIONS],
        "evidence": _evidence(result, baseline),
        "caveats": [f"`{name}`: {MITIGATIONS[name].caveat}" for name in result.mitigations if name in MITIGATIONS],
        "replay": replay,
        "trainer": trainer,
        "trainer_label": TRAINERS.get(trainer or "", ""),
        "changes": changes,
    }


def in_your_trainer(result: ReplayResult, trainer: str | None) -> list[dict[str, Any]]:
    """The attempt's mitigations as each trainer's setting, the trainer that wrote the snapshot first (as rows
    {trainer, label, mitigation, setting, note, wrote_it})."""
    order = ((trainer,) if trainer in TRAINERS else ()) + tuple(t for t in TRAINERS if t != trainer)
    rows = trainer_changes(normalise_config(result.mitigations), result.resolved_mitigations, order)
    return [
        {
            "trainer": c.trainer,
            "label": TRAINERS[c.trainer],
            "mitigation": c.mitigation,
            "setting": c.setting,
            "note": c.note,
            "wrote_it": c.trainer == trainer,
        }
        for c in rows
    ]


def replay_it(result: ReplayResult, workspace: Path, job: str) -> dict[str, Any]:
    """The command that replays this change, on a snapshot that outlives the investigation: a preserved copy is
    released when it ends (`report --release`), so the command names the rotating `iter_<N>` the copy was made
    from when that exists; it records into `workspace` (the task of `job`) from any directory. {command, snapshot
    (the path the command names), source (the rotating path or None), note}."""
    source = source_of_copy(result.snapshot)
    path = str(source) if source is not None and source.is_dir() else result.snapshot
    args = ["axrl-spike-replay", "replay", path]
    for item in mitigation_args(normalise_config(result.mitigations)):
        args += ["--mitigation", item]
    note = None
    if result.patch_sha256:
        args += ["--backend", "command", "--patch", "PATCH.diff"]
        note = "PATCH.diff: the patch above (its sha256 must match), run by the trainer's own replay command"
    if path != result.snapshot:
        moved = (
            f"Replayed from the preserved copy `{result.snapshot}`, {RELEASED_LATER}; the command names the rotating "
            "snapshot it was copied from, which stays until the job's rotation removes it"
        )
        note = f"{moved}. {note}" if note else moved
    return {
        "command": in_workspace(shlex.join(args), workspace, job, result.job_name),
        "snapshot": path,
        "source": None if source is None else str(source),
        "note": note,
    }


def _evidence(result: ReplayResult, baseline: Baseline) -> list[str]:
    """What the replay showed, in numbers: the norm it removed, and what it left of the healthy gradient."""
    lines = [
        f"grad norm {fmt(baseline.grad_norm)} -> {fmt(result.grad_norm)} ({pct(result.change_vs_baseline)}) at "
        f"{result.fidelity} fidelity; ratio to median {fmt(result.spike_ratio)} vs threshold {fmt(result.threshold)}"
    ]
    clean = result.clean_gradient or CleanGradient()
    if result.cosine_to_clean is not None:
        lines.append(
            f"cosine to the clean gradient: {fmt(result.cosine_to_clean)} (the unmitigated baseline: "
            f"{fmt(clean.baseline_cosine)}); the clean gradient is {clean.describe()}"
        )
    footprint = result.footprint
    if footprint:
        lines.append(
            f"footprint: {footprint.masked_tokens} loss tokens masked and {footprint.changed_tokens} "
            f"changed of {footprint.loss_tokens} ({pct(footprint.token_fraction).lstrip('+')}); "
            f"{footprint.touched_samples} of {footprint.samples} samples touched"
        )
    return lines


def _residual(result: ReplayResult, baseline: Baseline) -> str:
    ratio, threshold = result.spike_ratio, result.threshold
    label = threshold_label(result.verdict_basis)  # a user's clear threshold is not the detector's
    if ratio is None:
        return "unknown: the mitigated replay has no ratio to the median"
    if threshold is None:  # a result rebuilt from a task row that lost it
        return "unknown: the mitigated replay has no threshold to compare with"
    if ratio < threshold:
        return f"no residual spike: ratio to median {fmt(ratio)} is below the {label} {fmt(threshold)}"
    return (
        f"residual spike: ratio to median {fmt(ratio)} is still at or above the {label} "
        f"{fmt(threshold)}, though the grad norm moved {pct(result.change_vs_baseline)} against the baseline"
    )


def _patch_text(row: ExperimentRow, result: ReplayResult) -> str | None:
    """The patch itself when a `*.diff`/`*.patch` beside the replay result matches its hash."""
    if not result.patch_sha256 or not row.result_path:
        return None
    folder = Path(row.result_path).parent
    if not folder.is_dir():
        return None
    for candidate in sorted([*folder.glob("*.diff"), *folder.glob("*.patch")]):
        data = candidate.read_bytes()
        if hashlib.sha256(data).hexdigest() == result.patch_sha256:
            return data.decode("utf-8", errors="replace")
    return None
