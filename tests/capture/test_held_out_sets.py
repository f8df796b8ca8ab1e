"""Each held-out set is what a held-out figure needs: kinds no preset and no earlier set uses (so no rule was written
for them), at least two architectures and both world sizes, one case with two faults on two ranks, each case on its
own model; sets written once the two bases that spike on their own were known avoid them."""

from __future__ import annotations

import pytest

from axrl_spike_replay.capture.fault_injection.held_out_iii_faults import HELD_OUT_III_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_iv_faults import HELD_OUT_IV_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_ix_faults import HELD_OUT_IX_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_v_faults import HELD_OUT_V_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_vi_faults import HELD_OUT_VI_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_vii_faults import HELD_OUT_VII_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_viii_faults import HELD_OUT_VIII_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_x_faults import HELD_OUT_X_KINDS
from axrl_spike_replay.testing.fault_matrix import kinds_taken_before, matrix_cases

TWO = {"tiny_moe", "qwen2_moe"}
THREE = {"tiny_moe", "qwen2_moe", "olmoe"}
SPIKE_ON_THEIR_OWN = {("tiny_moe", "expert_sensitive", 2), ("tiny_moe", "peaked_kl", 4)}  # healthy bases that spike

# provenance, its kinds, at least this many kinds and cases, these models, every declared kind used, avoids the bases
SETS = [
    ("held_out_iii", HELD_OUT_III_KINDS, 8, 8, TWO, False, False),
    ("held_out_iv", HELD_OUT_IV_KINDS, 10, 10, TWO, True, False),
    ("held_out_v", HELD_OUT_V_KINDS, 8, 12, THREE, True, False),
    ("held_out_vi", HELD_OUT_VI_KINDS, 8, 10, THREE, True, False),
    ("held_out_vii", HELD_OUT_VII_KINDS, 8, 10, THREE, True, False),
    ("held_out_viii", HELD_OUT_VIII_KINDS, 8, 10, THREE, True, False),
    ("held_out_ix", HELD_OUT_IX_KINDS, 6, 10, THREE, True, True),
    ("held_out_x", HELD_OUT_X_KINDS, 6, 10, THREE, True, True),
]


@pytest.mark.parametrize(("provenance", "declared", "least_kinds", "least_cases", "models", "every", "avoids"), SETS)
def test_a_held_out_set_uses_kinds_no_preset_and_no_earlier_set_uses(
    provenance: str,
    declared: tuple[str, ...],
    least_kinds: int,
    least_cases: int,
    models: set[str],
    every: bool,
    avoids: bool,
) -> None:
    cases = matrix_cases((provenance,))
    kinds = {s.kind for c in cases for s in c.faults}
    assert kinds.isdisjoint(kinds_taken_before(provenance))
    assert (kinds == set(declared)) if every else (kinds <= set(declared))
    assert len(kinds) >= least_kinds and len(cases) >= least_cases
    assert {c.model for c in cases} >= models and {c.world_size for c in cases} >= {2, 4}
    doubles = [c for c in cases if len(c.expected_ranks(c.world_size)) >= 2 and len(c.faults) >= 2]
    assert doubles, "one case plants two faults on two ranks"
    assert all(c.model is not None for c in cases), "each case names its own model"
    if avoids:
        assert not {(c.model, c.preset, c.world_size) for c in cases} & SPIKE_ON_THEIR_OWN
