"""The fault matrix: spikes with a known broken part, captured by the reference trainer, to judge a diagnosis by.

Each `MatrixCase` is a run of the reference trainer with one trainer bug planted during the burst (a preset of
`capture.reference.presets`, plus faults of `capture.fault_injection.faults` of its own), the cause family it plants and
the ranks it hits.
Its provenances:

- `preset`: the family presets (`presets.FAMILY_PRESETS`), one per family;
- `variant`: a family preset's fault with other parameters or ranks;
- `held_out`, `unseen`, `held_out_ii` ... `held_out_x`: held-out sets (`testing.held_out_sets`, one module per
  set), each of faults no earlier provenance uses, written and committed before any rule was run on them; each
  case names its own model and world size.

`capture_command` is the same run as an `axrl-spike-replay capture` command line. `capture_case` records a case
with `hide_fault`, so the snapshots and the log do not name the preset or the fault:
whatever diagnoses them must find the broken part from the evidence. `benchmarks/bench_diagnosis.py` runs the
matrix; `skills/axrl-spike-replay/evals/evals.json` holds the presets' cases as skill evals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from axrl_spike_replay.capture.reference.presets import FAMILY_PRESETS, FAULT_FAMILIES, PRESETS, FaultSpec
from axrl_spike_replay.testing.held_out_sets.first_sets import HELD_OUT, HELD_OUT_II, HELD_OUT_III, HELD_OUT_IV, UNSEEN
from axrl_spike_replay.testing.held_out_sets.held_out_ix import HELD_OUT_IX
from axrl_spike_replay.testing.held_out_sets.held_out_v import HELD_OUT_V
from axrl_spike_replay.testing.held_out_sets.held_out_vi import HELD_OUT_VI
from axrl_spike_replay.testing.held_out_sets.held_out_vii import HELD_OUT_VII
from axrl_spike_replay.testing.held_out_sets.held_out_viii import HELD_OUT_VIII
from axrl_spike_replay.testing.held_out_sets.held_out_x import HELD_OUT_X
from axrl_spike_replay.testing.matrix_case import MatrixCase

PROVENANCES = (
    "preset",
    "variant",
    "held_out",
    "unseen",
    "held_out_ii",
    "held_out_iii",
    "held_out_iv",
    "held_out_v",
    "held_out_vi",
    "held_out_vii",
    "held_out_viii",
    "held_out_ix",
    "held_out_x",
)
MATRIX_STEPS = 24  # the burst is at iterations 20-22


def _preset_cases() -> list[MatrixCase]:
    return [MatrixCase(name, family, name, "preset") for family, name in FAMILY_PRESETS.items()]


_VARIANTS = (
    MatrixCase(
        "variant:reward_scale_rank0",
        "outlier_advantage",
        "reinforce_baseline",
        "variant",
        (FaultSpec("reward_scale", ranks=(0,), samples=(2,), params={"factor": 1000.0, "offset": 10.0}),),
    ),
    MatrixCase(
        "variant:half_foreign_shard",
        "one_rank_data",
        "peaked",
        "variant",
        (FaultSpec("off_policy_responses", ranks=(0,), params={"fraction": 0.5}),),
    ),
    MatrixCase(
        "variant:mask_two_early",
        "mask_misalignment",
        "peaked",
        "variant",
        (FaultSpec("mask_shift", ranks=(0,), params={"shift": 2}),),
    ),
)


def matrix_cases(provenances: tuple[str, ...] = PROVENANCES) -> list[MatrixCase]:
    """The matrix's cases of the given provenances, presets first."""
    unknown = set(provenances) - set(PROVENANCES)
    if unknown:
        raise ValueError(f"unknown provenance {sorted(unknown)} (known: {', '.join(PROVENANCES)})")
    cases = [
        *_preset_cases(),
        *_VARIANTS,
        *HELD_OUT,
        *UNSEEN,
        *HELD_OUT_II,
        *HELD_OUT_III,
        *HELD_OUT_IV,
        *HELD_OUT_V,
        *HELD_OUT_VI,
        *HELD_OUT_VII,
        *HELD_OUT_VIII,
        *HELD_OUT_IX,
        *HELD_OUT_X,
    ]
    return [c for c in cases if c.provenance in provenances]


def case_faults(case: MatrixCase) -> list[Any]:
    """The case's own faults as `capture.fault_injection.faults` objects (the preset's own fault the trainer builds
    itself)."""
    from axrl_spike_replay.capture.fault_injection.faults import make_fault

    return [make_fault(spec) for spec in case.faults]


def capture_case(
    case: MatrixCase,
    out: str | Path,
    *,
    model: str = "tiny_moe",
    seed: int = 0,
    world_size: int | None = None,
    steps: int = MATRIX_STEPS,
) -> Any:
    """Record `case` under `out` with the fault hidden from the snapshots (a `CaptureResult`); `world_size` None:
    the case's."""
    from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run

    return capture_reference_run(
        out,
        run=f"{case.name.replace(':', '-')}-s{seed}",
        world_size=case.world_size if world_size is None else world_size,
        steps=steps,
        seed=seed,
        preset=case.preset,
        model=model,
        faults=case_faults(case),
        hide_fault=True,
    )


def capture_command(case: MatrixCase, out: str, *, model: str = "tiny_moe", seed: int = 0) -> str:
    """The CLI command that records `case` as `capture_case` does (the fault hidden from the snapshots)."""
    import json
    import shlex

    words = [
        "axrl-spike-replay", "capture", "--out", out, "--world-size", str(case.world_size),
        "--steps", str(MATRIX_STEPS), "--seed", str(seed), "--preset", case.preset, "--model", model, "--hide-fault",
    ]  # fmt: skip
    for spec in case.faults:
        words += ["--fault", json.dumps(spec.to_dict(), separators=(",", ":"))]
    return shlex.join(words)


def burst_snapshots(result: Any, preset: str) -> list[Path]:
    """The snapshots of `result` taken at the preset's burst iterations (a spike elsewhere is the run's own), the
    largest spike first: a burst of several steps can also trip the detector on a mild step, and which steps do
    depends on the machine's arithmetic, while the burst's largest spike is the one the fault makes."""
    return largest_spike_first(result.snapshot_dirs, result.config["train"].get("burst") or ())


def largest_spike_first(snapshots: Iterable[Path], burst: Iterable[int]) -> list[Path]:
    """The `snapshots` taken at a `burst` iteration, the largest spike first (a non-finite step, NaN or inf norm, is
    the largest spike there is; equal ratios keep the earlier iteration first): what a fresh capture and a kept one
    (`bench_diagnosis --reuse`) both diagnose first."""
    from axrl_spike_replay.snapshot.metadata import read_metadata

    at = set(burst)
    taken = [(read_metadata(p)[0], p) for p in snapshots]
    at_burst = [(meta.spike_ratio, meta.iteration, p) for meta, p in taken if meta.iteration in at]
    return [p for *_, p in sorted(at_burst, key=lambda t: (-t[0] if math.isfinite(t[0]) else -math.inf, t[1]))]


# Cause ids of earlier diagnoses, read as the family each named (a record or report written before the families).
OLD_FAMILY_IDS = {
    "logprob_mismatch": "engine_mismatch",
    "routing_mismatch": "routing_payload",
    "one_rank": "one_rank_data",
    "none_found": "natural_spike",
}


def family_id(name: str) -> str:
    """The cause family `name` denotes: itself, or the family an earlier diagnosis's cause id stood for."""
    return OLD_FAMILY_IDS.get(name, name)


def known_family(name: str) -> bool:
    """Whether `name` (after `family_id`) is one of the families."""
    return family_id(name) in FAULT_FAMILIES


def kinds_taken_before(provenance: str) -> set[str]:
    """The fault kinds a new held-out set must avoid: every preset's and every held-out provenance's before
    `provenance` (from `held_out` on, in `PROVENANCES` order)."""
    earlier = PROVENANCES[PROVENANCES.index("held_out") : PROVENANCES.index(provenance)]
    kinds = {spec.kind for case in matrix_cases(earlier) for spec in case.faults}
    return kinds | {p.injected.kind for p in PRESETS.values() if p.injected is not None}
