"""The cause families `diagnose` names: a stable vocabulary, shared by the diagnosis, the fault presets that plant
them, the fault-matrix benchmark and the skill evals that score a report against them.

Each id names the broken part (see the package doc for what each one means). The ids themselves live in the ground
`vocabulary` (capture's fault presets, on a lower floor, read them there); torch-free.
"""

from __future__ import annotations

from axrl_spike_replay.vocabulary import CAUSE_FAMILIES

FAMILIES = CAUSE_FAMILIES
LOSS_TERMS = ("policy", "kl", "entropy", "aux", "z")
# families whose broken part is a stored signal of some ranks (the fix is in the trainer that stored it)
STORED_SIGNAL_FAMILIES = ("stale_old_logprobs", "bad_ref_logprobs", "routing_payload", "mask_misalignment")


def check_family(name: str) -> str:
    """`name` when it is one of FAMILIES, else ValueError naming the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"{name!r} is not a cause family (known: {', '.join(FAMILIES)})")
    return name


# The catalogue's symptom groups (`experiment.mitigation.mitigation_declaration.SYMPTOMS`) each family shows: the
# production settings advised under them (`family_fixes`) are the settings a trainer can keep against that family.
FAMILY_SYMPTOMS: dict[str, tuple[str, ...]] = {
    "engine_mismatch": ("mismatch",),
    # stale old log-probs disagree with the rollout's on the tokens they are stale on: the mismatch reading
    "stale_old_logprobs": ("stored_signal", "one_rank", "mismatch"),
    "bad_ref_logprobs": ("stored_signal", "one_rank", "kl"),
    # routes that moved the policy far from the reference show on the KL term (the catalogue's `kl` symptom)
    "routing_payload": ("stored_signal", "one_rank", "routing", "kl"),
    "outlier_advantage": ("outlier_advantage",),
    # the mask covers tokens whose stored log-probs are 0 fills: extreme log-ratios there, as a mismatch has
    "mask_misalignment": ("stored_signal", "one_rank", "mismatch"),
    "negative_advantage_dominance": ("negative_advantages",),
    "one_rank_data": ("one_rank",),
    # a -inf log-prob is an infinite log-ratio
    "non_finite": ("mismatch",),
    "step_not_reproduced": (),  # the replay does not give the recorded step: no setting of the replay is the fix
    # no broken part: the hard batch's ratios and advantages, bounded by the loss's own guards
    "natural_spike": ("policy_drift", "negative_advantages", "mismatch"),
}
# families whose broken part can be a value or scale made outside the loss (a NaN reward, a rank's loss scale, a rank
# fed other data, a loss mask built wrong) that no replay setting undoes: their fix may be the trainer-side change
TRAINER_SIDE = ("one_rank_data", "non_finite", "step_not_reproduced", "mask_misalignment")
# The trainer-side change each such family's fix is, as an engineer makes it where the broken part is built.
TRAINER_FIXES: dict[str, str] = {
    "one_rank_data": "make that rank's data loader read the run's own shard (its source, its sampling) and check "
    "each rank's batch against the rollout that produced it before the step",
    "non_finite": "guard the reward and advantage code: a reward that is not finite (a verifier timeout, a parse "
    "failure) is dropped with its group, or counted as a failure, before advantages are computed",
    "step_not_reproduced": "find where the rank's loss or gradients are scaled outside the recorded config "
    "(normalisation, micro-batch count, a loss scale never removed) and make the config say it or remove it",
    "mask_misalignment": "build each rank's loss mask from the response span it trains on: 1 on exactly the "
    "response tokens, shifted with the labels, 0 on prompt and padding, as a 0/1 mask (never per-token weights: "
    "the loss's aggregation does the weighting); assert before the loss that it is binary and sums to the "
    "response lengths",
}


def trainer_fix(family: str) -> str | None:
    """The trainer-side change that fixes `family` (`TRAINER_FIXES`); None where a production setting is its fix."""
    return TRAINER_FIXES.get(check_family(family))


def family_fixes(family: str) -> list[str]:
    """The production settings of `family`: the mitigations the catalogue advises under its symptoms that a trainer
    can keep (no diagnostic, no hypothesis, no other weights), in declaration order; [] when none can be."""
    from axrl_spike_replay.experiment.mitigation.mitigations import advised_settings

    return advised_settings(FAMILY_SYMPTOMS[check_family(family)])
