"""Regenerate the golden fixture snapshots under tests/fixtures/outputs/ from real reference-trainer captures.

    .venv/bin/python scripts/make_fixtures.py

Both fixtures are world size 2, seed 0, preset ratio_outliers (burst at iterations 20-21), with a
tiny model (d_model 16) so the files stay small: `fx~fixture-moe__actor` in the current layout with
both spike snapshots, `fx~fixture-legacy__actor` in the legacy layout (AXRL keys in metadata.json)
with the newest one.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "outputs"
STEPS = 21
BURST = [20, 21]
MODEL = {"d_model": 16, "d_ff": 32, "n_heads": 2, "max_seq_len": 16}
RUNS = {"fixture-moe": (False, 2), "fixture-legacy": (True, 1)}  # job -> (legacy layout, snapshots kept)


def main() -> int:
    """Rewrite both fixture output dirs; print what was captured."""
    logging.basicConfig(level=logging.ERROR)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for job, (legacy, keep_last) in RUNS.items():
        target = FIXTURES / f"fx~{job}__actor"
        if target.exists():
            shutil.rmtree(target)
        result = capture_reference_run(
            FIXTURES,
            job=job,
            run="fx",
            world_size=2,
            steps=STEPS,
            seed=0,
            preset="ratio_outliers",
            overrides={"model": MODEL, "train": {"burst": BURST, "prompts_per_rank": 2, "keep_last": keep_last}},
            legacy_layout=legacy,
        )
        if result.spike_iterations != BURST:
            print(f"{job}: spikes at {result.spike_iterations}, expected {BURST}", file=sys.stderr)
            return 1
        size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        ratios = ", ".join(f"{r:.1f}" for r in result.spike_ratios)
        print(f"{target.name}: snapshots {result.spike_iterations} (spike ratios {ratios}), {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
