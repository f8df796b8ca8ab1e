"""The diagnosis in the task: `diagnose`'s ranked causes, the snapshot's consistency and the experiments to run,
kept in the task state (`diagnoses`, one entry per snapshot diagnosed) and written into Observations and Next
steps; the report's Diagnosis section reads the entry of the task's snapshot.

How `task open` gets it cheaply: it runs `diagnose` once per snapshot it is given (re-opening with the same
snapshot does not run it again) with the model evidence mode `diagnosis`, by default `never`: the static
evidence only (batch signals, per-rank grad info, the consistency checks and the job's log, skipped above
256 MiB), without loading the weights (half a second on the reference fixture), which already names a
log-prob mismatch, an outlier advantage, negative-advantage dominance or non-finite values. What needs the
model (per-sample attribution, route agreement per MoE layer, hence routing mismatch and one rank's share of
the norm) is listed under "not checked"; `auto` computes it on the CPU when the checkpoint is at most 256 MiB
(seconds to tens of seconds for the reference model on a small machine: 20 s on the fixture on 2 busy cores),
`always` whatever the size; `off` opens the task without a diagnosis. On a large model, run `attribute`, then
`diagnose --attribution` for the full picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.workspace.changes import config_key

DIAGNOSIS_MODES = ("auto", "always", "never", "off")


def check_mode(mode: str) -> str:
    """`mode` when it is one of DIAGNOSIS_MODES; ConfigError otherwise."""
    if mode not in DIAGNOSIS_MODES:
        raise ConfigError(f"`diagnosis` must be one of {', '.join(DIAGNOSIS_MODES)}, got {mode!r}", "diagnosis")
    return mode


def diagnose_for_task(snapshot: str | Path, mode: str = "never") -> dict[str, Any]:
    """Run `diagnose` on `snapshot` and return its task entry; a snapshot it cannot read gives an entry whose
    `error` says why (the task still opens)."""
    from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot

    if check_mode(mode) == "off":
        raise ConfigError("`diagnosis` is off: nothing to run", "diagnosis")
    try:
        return diagnosis_entry(diagnose_snapshot(snapshot, model=mode), mode)
    except AxrlError as exc:
        return {"snapshot": str(snapshot), "model": mode, "error": str(exc), "causes": [], "next_steps": []}


def diagnosis_entry(d: Any, mode: str) -> dict[str, Any]:
    """A `Diagnosis` as the plain JSON entry the task keeps."""
    from axrl_spike_replay.diagnosis.causes import LIKELY
    from axrl_spike_replay.jsonable import to_jsonable

    consistency = None
    if d.consistency is not None:
        consistency = {
            "self_consistent": d.consistency.self_consistent,
            "agrees_with_log": d.consistency.agrees_with_log,
            "summary": d.consistency.summary(),
            "problems": [{"name": p.name, "message": p.message} for p in d.consistency.problems],
        }
    causes = [
        {
            "family": c.family,
            "title": c.title,
            "strength": c.strength,
            "likely": c.family == "none_found" or c.strength >= LIKELY,
            "evidence": list(c.evidence),
        }
        for c in d.causes
    ]
    steps = [{"mitigation": e.mitigation, "why": e.why, "diagnostic_only": e.diagnostic_only} for e in d.next_steps]
    return to_jsonable(
        {
            "snapshot": d.snapshot,
            "iteration": d.iteration,
            "grad_norm": d.grad_norm,
            "spike_ratio": d.spike_ratio,
            "model": mode,
            "causes": causes,
            "next_steps": steps,
            "consistency": consistency,
            "not_checked": list(d.not_checked),
        }
    )


def add_diagnosis(state: dict[str, Any], entry: dict[str, Any], time: str) -> None:
    """Keep `entry` in `state["diagnoses"]` and write it into Observations and Next steps."""
    state.setdefault("diagnoses", []).append({**entry, "time": time})
    observations, steps = state["observations"], state["next_steps"]
    where = f"iteration {entry['iteration']}" if entry.get("iteration") is not None else str(entry["snapshot"])
    if entry.get("error"):
        observations.append({"time": time, "text": f"diagnose could not read {entry['snapshot']}: {entry['error']}"})
        return
    likely = [c for c in entry["causes"] if c["likely"]]
    for i, cause in enumerate(likely, start=1):
        head = f"diagnose ({where}): cause {i} of {len(likely)}: {cause['title']} (strength {cause['strength']:.2f})"
        observations.append({"time": time, "text": "\n".join([head, *(f"- {e}" for e in cause["evidence"])])})
    if entry.get("consistency"):
        c = entry["consistency"]
        lines = [f"consistency ({where}): {c['summary']}", *(f"- [{p['name']}] {p['message']}" for p in c["problems"])]
        observations.append({"time": time, "text": "\n".join(lines)})
    if entry.get("not_checked"):
        observations.append({"time": time, "text": f"diagnose did not check: {'; '.join(entry['not_checked'])}"})
    for step in entry["next_steps"]:
        note = " (diagnostic only, never a production method)" if step["diagnostic_only"] else ""
        steps.append({"time": time, "text": f"replay `--mitigation {step['mitigation']}`: {step['why']}{note}"})


def has_diagnosis(state: dict[str, Any], snapshot: str) -> bool:
    """True when the task already holds a diagnosis of `snapshot`."""
    return any(d.get("snapshot") == snapshot for d in state.get("diagnoses", []))


def report_diagnosis(state: dict[str, Any]) -> dict[str, Any] | None:
    """The diagnosis the report shows: that of the task's snapshot (else the latest), each suggested experiment
    with the logged attempts that ran exactly that config and their verdicts."""
    entries = state.get("diagnoses") or []
    if not entries:
        return None
    own = [d for d in entries if d.get("snapshot") == state.get("snapshot")]
    entry = (own or entries)[-1]
    tried: dict[str, list[dict[str, Any]]] = {}
    for row in state["experiments"]:
        if not row.get("is_baseline") and not row.get("patch_sha256"):
            tried.setdefault(config_key(row.get("mitigations")), []).append(row)
    steps = []
    for step in entry.get("next_steps", []):
        rows = tried.get(_key_of(step["mitigation"]) or "", [])
        attempts = ", ".join(f"{r['id']} {r['verdict']}" for r in rows)
        steps.append({**step, "attempts": attempts or "not tried"})
    defaults = {"error": None, "consistency": None, "not_checked": [], "causes": [], "time": None}
    defaults |= {"iteration": None, "grad_norm": None, "spike_ratio": None, "model": None}
    likely = [c for c in entry.get("causes", []) if c.get("likely")]
    return {**defaults, **entry, "next_steps": steps, "likely": likely}


def task_diagnosis(workspace: str | Path, job: str) -> dict[str, Any] | None:
    """The diagnosis the report would show for the task of `job` (see `report_diagnosis`)."""
    from axrl_spike_replay.names import check_plain_name
    from axrl_spike_replay.workspace.paths import check_workspace
    from axrl_spike_replay.workspace.task_state import read_state

    return report_diagnosis(read_state(check_workspace(workspace), check_plain_name(job, "job name")))


def _key_of(item: str) -> str | None:
    """The config key of one `--mitigation` item (None when it is a template such as `initial_model=<...>`)."""
    from axrl_spike_replay.experiment.mitigations import parse_mitigation_args

    try:
        return config_key(parse_mitigation_args([item]))
    except AxrlError:
        return None
