#!/usr/bin/env python3
"""Write skills/axrl-spike-replay/evals/evals.json from the fault matrix (`testing.fault_matrix`).

One eval per matrix case and architecture, in the open skills spec's eval format (`skill_name`, `evals[]` with
`id`, `prompt`, `expected_output`, `files`, `expectations`), plus what a runner and `evals/score.py` need: how to
make the eval's snapshot (`snapshot.command`, the fault hidden from it) and the answer (`expected`: the cause family,
the ranks at fault, the family's fixes). `tests/skills/test_skill_evals.py` checks the file is what this writes.

Usage: .venv/bin/python scripts/make_skill_evals.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from axrl_spike_replay.capture.reference.presets import FAULT_FAMILIES
from axrl_spike_replay.testing.fault_matrix import MATRIX_WORLD_SIZE, OLD_FAMILY_IDS, capture_command, matrix_cases

SKILL = "axrl-spike-replay"
OUT = Path(__file__).resolve().parents[1] / "skills" / SKILL / "evals" / "evals.json"
ARCHITECTURES = ("qwen2_moe", "olmoe", "mixtral")  # transformers MoE architectures other than the demo's qwen3_moe

# What a report may call each family, and the replay-only levers that fix (or isolate) its broken part.
FAMILY_DOCS: dict[str, dict[str, list[str]]] = {
    "engine_mismatch": {
        "words": ["engine/trainer mismatch", "rollout/trainer log-prob mismatch", "training-inference mismatch"],
        "fixes": ["is_base_logprobs", "mismatch_token_clip_max", "ratio_outlier_mask"],
    },
    "stale_old_logprobs": {
        "words": ["stale old log-probs", "old log-probs", "old_logprobs"],
        "fixes": ["recompute", "drop_ranks", "keep_ranks"],
    },
    "bad_ref_logprobs": {
        "words": ["reference log-probs", "ref log-probs", "ref_logprobs"],
        "fixes": ["kl_coef", "kl_estimator", "kl_clamp", "drop_ranks", "keep_ranks"],
    },
    "routing_payload": {
        "words": ["routing payload", "recorded routes", "route agreement", "routing mismatch"],
        "fixes": ["recompute", "routing_replay", "current_routing_layers", "drop_ranks", "keep_ranks"],
    },
    "outlier_advantage": {
        "words": ["outlier advantage", "reward scale", "reward-scale"],
        "fixes": ["advantage_clip", "advantage_outlier_mask", "drop_samples"],
    },
    "mask_misalignment": {
        "words": ["loss mask", "mask misalignment", "misaligned mask", "truncated mask"],
        "fixes": ["drop_ranks", "keep_ranks", "drop_samples"],
    },
    "negative_advantage_dominance": {
        "words": ["negative-advantage dominance", "negative advantage dominance", "negative advantages"],
        "fixes": ["balance_negative_advantages", "advantage_clip"],
    },
    "one_rank_data": {
        "words": ["one rank's data", "one rank's batch", "data shard"],
        "fixes": ["drop_ranks", "keep_ranks", "drop_samples"],
    },
    "non_finite": {
        "words": ["non-finite", "nan reward", "nan value", "-inf"],
        "fixes": ["drop_samples", "drop_ranks", "keep_ranks"],
    },
    "step_not_reproduced": {
        "words": ["does not reproduce", "not reproduced", "gradient scale", "loss scale", "not the one it trained on"],
        "fixes": ["loss_scale", "drop_ranks", "keep_ranks"],
    },
    "natural_spike": {
        "words": ["natural spike", "hard batch", "no broken part"],
        "fixes": ["dual_clip_c", "log_ratio_clip", "ratio_outlier_mask", "clip_eps_low", "advantage_clip"],
    },
}

PROMPT = (
    "Our GRPO run of a {arch} mixture-of-experts model on {world} data-parallel ranks tripped its spike guard "
    "around iteration 20. The job's output directory is under {out}. Find what broke, show it with the snapshot's "
    "own numbers, and find a replay-only mitigation that clears the spike. End your report with three lines:\n"
    "Cause family: <one of {families}>\n"
    "Ranks: <the data-parallel ranks at fault, comma-separated, or none if every rank is affected>\n"
    "Fix: <NAME=VALUE of the mitigation that cleared the spike in replay>"
)


# the matrix's unseen cases stay the benchmark's held-out set (each on its own model and world size)
EVAL_PROVENANCES = ("preset", "variant", "held_out")


def build() -> dict[str, Any]:
    """The evals document."""
    evals = []
    for arch in ARCHITECTURES:
        for case in matrix_cases(EVAL_PROVENANCES):
            out = f"evals-out/{case.name.replace(':', '-')}-{arch}"
            ranks = case.expected_ranks(MATRIX_WORLD_SIZE)
            fixes = ", ".join(FAMILY_DOCS[case.family]["fixes"])
            where = f"rank {', '.join(map(str, ranks))}" if ranks else "every rank"
            evals.append(
                {
                    "id": len(evals) + 1,
                    "prompt": PROMPT.format(
                        arch=arch, world=MATRIX_WORLD_SIZE, out=out, families=", ".join(FAULT_FAMILIES)
                    ),
                    "expected_output": f"the cause family {case.family} ({where}), shown with the snapshot's figures, "
                    f"and a replay-proven fix of that family ({fixes})",
                    "files": [],
                    "expectations": [
                        f"The report's cause family is {case.family}",
                        f"The report names the ranks at fault: {ranks or 'none (every rank)'}",
                        f"The report's fix is one of {fixes}, proven by a replay",
                    ],
                    "snapshot": {
                        "command": capture_command(case, out, model=arch),
                        "case": case.name,
                        "provenance": case.provenance,
                        "model": arch,
                    },
                    "expected": {"family": case.family, "ranks": ranks},
                }
            )
    families = {
        fam: {**FAMILY_DOCS[fam], "old_ids": sorted(old for old, new in OLD_FAMILY_IDS.items() if new == fam)}
        for fam in FAULT_FAMILIES
    }
    return {"skill_name": SKILL, "families": families, "evals": evals}


def render() -> str:
    return json.dumps(build(), indent=1, ensure_ascii=False) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from what would be written")
    args = ap.parse_args()
    text = render()
    if args.check:
        same = OUT.is_file() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT}: {'up to date' if same else 'differs: run scripts/make_skill_evals.py'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}: {len(build()['evals'])} evals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
