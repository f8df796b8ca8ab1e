"""A diagnosis as the investigation's task keeps it: `diagnose` on a snapshot, run in the mode `task open` asks for,
as one plain JSON entry (causes, the snapshot's consistency, the experiments to run, what was not checked).

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

from axrl_spike_replay.diagnosis.diagnose import Diagnosis, diagnose_snapshot
from axrl_spike_replay.diagnosis.rules.causes import LIKELY
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.jsonable import to_jsonable

DIAGNOSIS_MODES = ("auto", "always", "never", "off")


def check_mode(mode: str) -> str:
    """`mode` when it is one of DIAGNOSIS_MODES; ConfigError otherwise."""
    if mode not in DIAGNOSIS_MODES:
        raise ConfigError(f"`diagnosis` must be one of {', '.join(DIAGNOSIS_MODES)}, got {mode!r}", "diagnosis")
    return mode


def diagnose_for_task(snapshot: str | Path, mode: str = "never") -> dict[str, Any]:
    """Run `diagnose` on `snapshot` and return its task entry; a snapshot it cannot read gives an entry whose
    `error` says why (the task still opens)."""
    if check_mode(mode) == "off":
        raise ConfigError("`diagnosis` is off: nothing to run", "diagnosis")
    try:
        return diagnosis_entry(diagnose_snapshot(snapshot, model=mode), mode)
    except AxrlError as exc:
        return {"snapshot": str(snapshot), "model": mode, "error": str(exc), "causes": [], "next_steps": []}


def diagnosis_entry(d: Diagnosis, mode: str) -> dict[str, Any]:
    """A `Diagnosis` as the plain JSON entry the task keeps."""
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
            "likely": c.family == "natural_spike" or c.strength >= LIKELY,
            "evidence": list(c.evidence),
            "ranks": list(c.ranks),
            "samples": [list(p) for p in c.samples],
            "term": c.term,
            "tied_with": list(c.tied_with),
        }
        for c in d.causes
    ]
    steps = [
        {"mitigation": e.mitigation, "why": e.why, "diagnostic_only": e.diagnostic_only, "refutes": e.refutes}
        for e in d.next_steps
    ]
    return to_jsonable(
        {
            "snapshot": d.snapshot,
            "iteration": d.iteration,
            "grad_norm": d.grad_norm,
            "spike_ratio": d.spike_ratio,
            "model": mode,
            "causes": causes,
            "next_steps": steps,
            "hypotheses": [{"mitigation": e.mitigation, "why": e.why} for e in d.hypotheses],
            "consistency": consistency,
            "not_checked": list(d.not_checked),
        }
    )
