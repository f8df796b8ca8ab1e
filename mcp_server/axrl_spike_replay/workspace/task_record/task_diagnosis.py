"""The diagnosis in the task: the entries `task open` and every later diagnosis run hand over (`diagnosis.task_entry`;
`diagnose` and the MCP `diagnose_spike` with a task open), kept in the task state (`diagnoses`) and written into
Observations and Next steps. The report's Diagnosis section reads the strongest entry of the task's snapshot (the one
that checked the most evidence, the latest among equals), with the attempts that ran each suggested experiment; Next
steps leaves out the experiments already run.
"""

from __future__ import annotations

import re
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.workspace.task_record.changes import config_key
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.task import TaskState


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
    _drop_settled_steps(state, entry, where, time)
    listed = {_step_mitigation(row) for row in steps}
    for step in entry["next_steps"]:
        if step["mitigation"] in listed:  # an earlier diagnosis suggested it already
            continue
        note = " (diagnostic only, never a production method)" if step["diagnostic_only"] else ""
        text = f"replay `--mitigation {step['mitigation']}`: {step['why']}{note}"
        steps.append({"time": time, "text": text, "mitigation": step["mitigation"], "snapshot": entry["snapshot"]})
    for step in entry.get("hypotheses") or []:
        if step["mitigation"] in listed:
            continue
        text = (
            f"replay the hypothesis `{step['mitigation']}` (`--mitigation {step['mitigation']}`), judged against the "
            f"recording: {step['why']}"
        )
        steps.append(
            {
                "time": time,
                "text": text,
                "mitigation": step["mitigation"],
                "hypothesis": True,
                "snapshot": entry["snapshot"],
            }
        )


def _drop_settled_steps(state: TaskState, entry: dict[str, Any], where: str, time: str) -> None:
    """When `entry` (just kept) is the strongest diagnosis of its snapshot, the experiments an earlier, weaker one of
    that snapshot suggested and this one does not are settled (the model evidence told the old from the rollout
    log-probs, say): they leave Next steps, and Observations says so."""
    own = [d for d in state.diagnoses if d.get("snapshot") == entry["snapshot"]]
    if len(own) < 2 or strongest(own) is not state.diagnoses[-1]:
        return
    suggested = {step["mitigation"] for step in [*entry["next_steps"], *(entry.get("hypotheses") or [])]}
    settled = [
        row
        for row in state.next_steps
        if row.get("snapshot") == entry["snapshot"] and row.get("mitigation") and row["mitigation"] not in suggested
    ]
    if not settled:
        return
    state.next_steps[:] = [row for row in state.next_steps if row not in settled]  # the caller holds the list
    items = ", ".join(f"`{row['mitigation']}`" for row in settled)
    state.observations.append(
        {
            "time": time,
            "text": f"diagnose ({where}, model evidence {entry.get('model')}) no longer suggests {items}, which an "
            "earlier diagnosis of this snapshot with less evidence did: left out of Next steps",
        }
    )


_STEP_RE = re.compile(r"^replay `--mitigation ([^`]+)`")


def _step_mitigation(row: dict[str, Any]) -> str | None:
    """The `--mitigation` item a Next steps row suggests (rows of older tasks: read from the text), else None."""
    if row.get("mitigation"):
        return str(row["mitigation"])
    match = _STEP_RE.match(str(row.get("text", "")))
    return match.group(1) if match else None


def tried_configs(state: TaskState) -> set[str]:
    """The config keys of the mitigated and hypothesis replays the task has logged."""
    return {config_key(_config_of(row)) for row in state.experiments if not row.is_baseline and not row.patch_sha256}


def _config_of(row: ExperimentRow) -> dict[str, Any] | None:
    """The config a logged row replayed: its hypothesis, or its mitigations."""
    return row.hypothesis or row.mitigations


def open_steps(state: TaskState) -> list[dict[str, Any]]:
    """Next steps without the experiments already run (a row whose suggested config a logged replay ran)."""
    tried = tried_configs(state)
    out = []
    for row in state.next_steps:
        item = _step_mitigation(row)
        if item is None or _key_of(item) not in tried:
            out.append(row)
    return out


def strongest(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The entry that checked the most: read without error, with the model evidence, the fewest things left
    unchecked; the latest among equals."""
    ranked = [
        (not e.get("error"), -len(e.get("not_checked") or []), e.get("model") in ("auto", "always"), i)
        for i, e in enumerate(entries)
    ]
    return entries[max(ranked)[3]]


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
    entry = strongest(own or entries)
    tried: dict[str, list[ExperimentRow]] = {}
    for row in state.experiments:
        if not row.is_baseline and not row.patch_sha256:
            tried.setdefault(config_key(_config_of(row)), []).append(row)

    def with_attempts(step: dict[str, Any]) -> dict[str, Any]:
        rows = tried.get(_key_of(step["mitigation"]) or "", [])
        attempts = ", ".join(f"{r.id} {r.finding or r.verdict}" for r in rows)
        return {**step, "attempts": attempts or "not tried"}

    steps = [with_attempts(step) for step in entry.get("next_steps", [])]
    hypotheses = [with_attempts(step) for step in entry.get("hypotheses") or []]
    defaults = {"error": None, "consistency": None, "not_checked": [], "causes": [], "time": None}
    defaults |= {"iteration": None, "grad_norm": None, "spike_ratio": None, "model": None}
    likely = [c for c in entry.get("causes", []) if c.get("likely")]
    return {**defaults, **entry, "next_steps": steps, "hypotheses": hypotheses, "likely": likely}


def _key_of(item: str) -> str | None:
    """The config key of one `--mitigation` item (None when it is a template such as `initial_model=<...>`)."""
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args

    try:
        return config_key(parse_mitigation_args([item]))
    except AxrlError:
        return None
