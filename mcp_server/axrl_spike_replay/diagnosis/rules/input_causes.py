"""A rank's input that fails a check against the model, as a cause: the lead finding, with its experiments.

`replay.reading.input_checks` holds every rank's routes, tokens, masks and stored log-probs to the run config's model.
Each failure is a fact about the snapshot (not a reading of signals): its rank, field, what fails and how often,
the healthy ranks as witnesses. As a cause it heads the list, scoped to its rank, with the experiments that remove
the bad part (recompute that rank's routes or stored log-probs, drop the rank); whether the bad part carries the
spike is what those experiments decide (one that clears it proves the cause). A rule that already named the same
family is merged into it (its evidence kept, the finding first, its ranks narrowed to the finding's).
"""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.diagnosis.rules.causes import LOSS_READS_LITTLE, Cause, Experiment
from axrl_spike_replay.errors import AxrlError

# the broken part each checked field names, as a cause family
FIELD_FAMILIES = {
    "routed_experts": "routing_payload",
    "old_logprobs": "stale_old_logprobs",
    "ref_logprobs": "bad_ref_logprobs",
    "rollout_logprobs": "engine_mismatch",
    "loss_mask": "mask_misalignment",
    "tokens": "one_rank_data",
}
# checks another rule reads already, scoped to the samples that hold them (non-finite values: `non_finite`)
READ_BY_RULES = frozenset({"nan_logprob"})
STRENGTH = 0.95  # the input is certainly corrupt; that it carries the spike is the experiments' to prove


def input_causes(snapshot: Path, world_size: int, not_checked: list[str]) -> list[Cause]:
    """One cause per family whose input fails a check against the run config's model; a line in
    `not_checked` when the checks cannot run (the run config's model does not parse, a rank file does not read)."""
    from axrl_spike_replay.models.policy import parse_model_config
    from axrl_spike_replay.replay.reading.input_checks import input_findings
    from axrl_spike_replay.replay.reading.inputs import read_run_config

    try:
        spec = parse_model_config(dict(read_run_config(snapshot)["model"]))
        findings = input_findings(snapshot, spec, world_size)
    except (AxrlError, TypeError, ValueError) as exc:
        not_checked.append(f"input checks against the model ({exc})")
        return []
    found: dict[str, Cause] = {}
    for finding in (f for f in findings if f.check not in READ_BY_RULES):
        family = FIELD_FAMILIES.get(finding.field, "one_rank_data")
        cause = found.get(family)
        if cause is None:
            title = f"rank {finding.rank}'s {finding.field} fails a check against the model"
            cause = found[family] = Cause(family, title, STRENGTH)
        if finding.rank not in cause.ranks:
            cause.ranks.append(finding.rank)
        cause.evidence.append(finding.message)
        cause.figures.setdefault("input_findings", []).append(
            {"check": finding.check, "count": finding.count, "total": finding.total, "defined": finding.defined}
        )
        for item in finding.experiments:
            if item not in {e.mitigation for e in cause.experiments}:
                why = (
                    f"leaves rank {finding.rank} out of the step"
                    if item.startswith("drop_ranks")
                    else f"replaces rank {finding.rank}'s {finding.field} by what the snapshot's weights give"
                )
                cause.experiments.append(
                    Experiment(item, why, diagnostic_only=True, refutes="the spike stays with the bad part removed")
                )
    for cause in found.values():
        if not any(e.mitigation.startswith("drop_ranks=") for e in cause.experiments):
            cause.experiments.append(_drop(cause.ranks))  # every corrupt input has a lever that removes it
    return list(found.values())


def _drop(ranks: list[int]) -> Experiment:
    listed = ",".join(str(r) for r in sorted(ranks))
    return Experiment(
        f"drop_ranks={listed}",
        f"leaves rank {listed} out of the step",
        diagnostic_only=True,
        refutes="the spike stays with the bad part removed",
    )


def merge_input_causes(found: list[Cause], inputs: list[Cause]) -> list[Cause]:
    """`found` with each input cause merged into the rule's cause of the same family (or added)."""
    for extra in inputs:
        same = next((c for c in found if c.family == extra.family), None)
        if same is None:
            found.append(extra)
            continue
        if same.figures.get(LOSS_READS_LITTLE):  # the input is corrupt, but the loss barely reads it: not the cause
            extra.evidence.append("the input fails its check, but this run's loss barely reads it (see below)")
        else:
            same.strength = max(same.strength, extra.strength)
        same.evidence = [*extra.evidence, *same.evidence]
        same.figures = {**same.figures, **extra.figures}
        same.ranks = list(extra.ranks)
        known = {e.mitigation for e in extra.experiments}
        same.experiments = [*extra.experiments, *(e for e in same.experiments if e.mitigation not in known)]
    return found
