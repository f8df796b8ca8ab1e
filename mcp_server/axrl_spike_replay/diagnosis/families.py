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
