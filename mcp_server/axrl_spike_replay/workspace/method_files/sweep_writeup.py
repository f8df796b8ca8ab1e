"""Write up what a sweep proved: one method file per config that cleared (or reduced) the spike."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.mitigation.mitigation_sets import DIAGNOSTIC_ONLY, SEED_WORKFLOW_METHODS
from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS, config_id
from axrl_spike_replay.experiment.result import ReplayResult, SweepResult
from axrl_spike_replay.experiment.verdict import threshold_label
from axrl_spike_replay.vocabulary import Fidelity
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.task_record.task_state import show_task


@dataclass
class WriteUp:
    """One sweep config's fate: the method file written, or why not."""

    config_id: str
    name: str
    verdict: str
    path: str | None = None
    skipped: str | None = None


_PROSE_WORD_RE = re.compile(r"[a-z][a-z'-]*(?:[\s,.:;]|$)")  # a first word in lower-case letters only


def method_name(cfg_id: str) -> str:
    """The seed workflow's name for a config it records, else a slug of the config id."""
    names = {config_id(c): name for name, c in SEED_WORKFLOW_METHODS.items()}
    return names.get(cfg_id, re.sub(r"[^a-z0-9]+", "-", cfg_id.lower()).strip("-"))


def rationale_for(result: ReplayResult, threshold: float, context: str = "") -> str:
    """Why the change works, from the mitigations' own documentation and the replay's figures, as a sentence."""
    docs = "; ".join(MITIGATIONS[name].doc for name in result.mitigations if name in MITIGATIONS)
    return as_sentence(
        f"{context}{docs}. Replayed at {result.fidelity} fidelity, it took the spike step's grad norm from "
        f"{result.baseline_grad_norm:.4g} to {result.grad_norm:.4g} (ratio to median {result.spike_ratio:.3g}, "
        f"{threshold_label(result.verdict_basis)} {threshold:g})."
    )


def as_sentence(text: str) -> str:
    """`text` with its first letter upper case when its first word is plain lower-case prose (a mitigation's
    documentation reads `mask tokens ...`); a first word that is code (`ratio_outlier_mask`) is left as it is."""
    return text[0].upper() + text[1:] if _PROSE_WORD_RE.match(text) else text


def write_up_sweep(
    workspace: str | Path,
    job: str,
    sweep: SweepResult,
    *,
    verdicts: Collection[str] = ("cleared",),
    context: str = "",
) -> list[WriteUp]:
    """Add a method for each full-fidelity config of `sweep` whose verdict is in `verdicts`.

    Diagnostic-only configs (routing replay off) are never written up; duplicates and other refusals
    are reported in `skipped`, never raised.
    """
    experiments = show_task(workspace, job).experiments
    attempts = {str(Path(e.result_path).resolve()): e.id for e in experiments if e.result_path}
    done = []
    for result in sweep.results:
        item = WriteUp(result.config_id, method_name(result.config_id), result.verdict)
        done.append(item)
        if result.verdict not in verdicts:
            item.skipped = f"verdict {result.verdict}"
            continue
        if item.name in DIAGNOSTIC_ONLY or result.fidelity != Fidelity.FULL:
            item.skipped = "diagnostic only"
            continue
        attempt = attempts.get(str((Path(sweep.output_dir) / result.config_id / "replay_result.json").resolve()))
        if attempt is None:
            item.skipped = "not logged in the task file"
            continue
        try:
            rationale = rationale_for(result, sweep.threshold, context)
            item.path = add_method(workspace, job, attempt, item.name, rationale).path
        except AxrlError as exc:
            item.skipped = str(exc)
    return done
