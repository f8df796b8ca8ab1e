"""The diagnosis in the task: the entries `task open` hands over (`diagnosis.task_entry`), kept in the task state
(`diagnoses`, one entry per snapshot diagnosed) and written into Observations and Next steps; the report's
Diagnosis section reads the entry of the task's snapshot, with the attempts that ran each suggested experiment.
"""

from __future__ import annotations

from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.workspace.changes import config_key
from axrl_spike_replay.workspace.task import TaskState


def add_diagnosis(state: TaskState, entry: dict[str, Any], time: str) -> None:
    """Keep `entry` in `state.diagnoses` and write it into Observations and Next steps."""
    state.diagnoses.append({**entry, "time": time})
    observations, steps = state.observations, state.next_steps
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


def has_diagnosis(state: TaskState, snapshot: str) -> bool:
    """True when the task already holds a diagnosis of `snapshot`."""
    return any(d.get("snapshot") == snapshot for d in state.diagnoses)


def report_diagnosis(state: TaskState) -> dict[str, Any] | None:
    """The diagnosis the report shows: that of the task's snapshot (else the latest), each suggested experiment
    with the logged attempts that ran exactly that config and their verdicts."""
    entries = state.diagnoses
    if not entries:
        return None
    own = [d for d in entries if d.get("snapshot") == state.snapshot]
    entry = (own or entries)[-1]
    tried: dict[str, list[dict[str, Any]]] = {}
    for row in state.experiments:
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


def _key_of(item: str) -> str | None:
    """The config key of one `--mitigation` item (None when it is a template such as `initial_model=<...>`)."""
    from axrl_spike_replay.experiment.mitigations import parse_mitigation_args

    try:
        return config_key(parse_mitigation_args([item]))
    except AxrlError:
        return None
