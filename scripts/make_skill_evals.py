#!/usr/bin/env python3
"""Write skills/axrl-spike-replay/evals/evals.json from the fault matrix (`testing.fault_matrix`).

One eval per matrix case and architecture, in the open skills spec's eval format (`skill_name`, `evals[]` with
`id`, `prompt`, `expected_output`, `files`, `expectations`), plus what a runner and `evals/score.py` need: how to
make the eval's snapshot (`snapshot.command`, the fault hidden from it) and the answer (`expected`: the cause family
and the ranks at fault). Each family lists the experiments that prove it (`proofs`: levers that remove or isolate
its broken part) and its production fixes (`fixes`: the settings the mitigation catalogue advises against the
family's symptoms that a trainer can keep, `diagnosis.families.family_fixes`, never a list of past answers), and
whether its fix may be the trainer-side change (`trainer_side`), and which change that is (`trainer_fix`).
`tests/skills/test_skill_evals.py` checks the file is what this writes.

Usage: .venv/bin/python scripts/make_skill_evals.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from axrl_spike_replay.capture.reference.presets import FAULT_FAMILIES
from axrl_spike_replay.diagnosis.families import TRAINER_SIDE, family_fixes, trainer_fix
from axrl_spike_replay.testing.fault_matrix import OLD_FAMILY_IDS, capture_command, matrix_cases
from axrl_spike_replay.testing.matrix_case import MATRIX_WORLD_SIZE

SKILL = "axrl-spike-replay"
OUT = Path(__file__).resolve().parents[1] / "skills" / SKILL / "evals" / "evals.json"
ARCHITECTURES = ("qwen2_moe", "olmoe", "mixtral")  # transformers MoE architectures other than the demo's qwen3_moe

# What a report may call each family, and the replay-only experiments that prove it: levers that remove or isolate its
# broken part (a diagnostic such as drop_ranks or recompute, or the one setting the family is about). The production
# fixes are not listed here: they come from the mitigation catalogue (`family_fixes`).
FAMILY_DOCS: dict[str, dict[str, list[str]]] = {
    "engine_mismatch": {
        "words": ["engine/trainer mismatch", "rollout/trainer log-prob mismatch", "training-inference mismatch"],
        # recompute=rollout_logprobs: an engine that agreed with the trainer (the stored signal the family is about)
        "proofs": ["is_base_logprobs", "mismatch_token_clip_max", "ratio_outlier_mask", "recompute"],
    },
    "stale_old_logprobs": {
        "words": ["stale old log-probs", "old log-probs", "old_logprobs"],
        "proofs": ["recompute", "drop_ranks", "keep_ranks"],
    },
    "bad_ref_logprobs": {
        "words": ["reference log-probs", "ref log-probs", "ref_logprobs"],
        "proofs": ["kl_coef", "kl_estimator", "kl_clamp", "drop_ranks", "keep_ranks"],
    },
    "routing_payload": {
        "words": ["routing payload", "recorded routes", "route agreement", "routing mismatch"],
        "proofs": ["recompute", "routing_replay", "current_routing_layers", "drop_ranks", "keep_ranks"],
    },
    "outlier_advantage": {
        "words": ["outlier advantage", "reward scale", "reward-scale"],
        "proofs": ["advantage_clip", "advantage_outlier_mask", "drop_samples"],
    },
    "mask_misalignment": {
        "words": ["loss mask", "mask misalignment", "misaligned mask", "truncated mask"],
        "proofs": ["drop_ranks", "keep_ranks", "drop_samples"],
    },
    "negative_advantage_dominance": {
        "words": ["negative-advantage dominance", "negative advantage dominance", "negative advantages"],
        "proofs": ["balance_negative_advantages", "advantage_clip"],
    },
    "one_rank_data": {
        "words": ["one rank's data", "one rank's batch", "data shard"],
        "proofs": ["drop_ranks", "keep_ranks", "drop_samples"],
    },
    "non_finite": {
        "words": ["non-finite", "nan reward", "nan value", "-inf"],
        "proofs": ["drop_samples", "drop_ranks", "keep_ranks"],
    },
    "step_not_reproduced": {
        "words": ["does not reproduce", "not reproduced", "gradient scale", "loss scale", "not the one it trained on"],
        "proofs": ["loss_scale", "drop_ranks", "keep_ranks"],
    },
    "natural_spike": {
        "words": ["natural spike", "hard batch", "no broken part"],
        "proofs": ["dual_clip_c", "log_ratio_clip", "ratio_outlier_mask", "clip_eps_low", "advantage_clip"],
    },
}

PROMPT = (
    "Our GRPO run of a {arch} mixture-of-experts model on {world} data-parallel ranks tripped its spike guard "
    "around iteration 20. The job's output directory is under {out}. Find what broke, show it with the snapshot's "
    "own numbers, prove the cause with a replay experiment, and find the fix. End your report with four lines:\n"
    "Cause family: <one of {families}>\n"
    "Ranks: <the data-parallel ranks at fault, comma-separated, or none if every rank is affected>\n"
    "Proof: <NAME=VALUE of the replay experiment that moved or cleared the spike by removing or isolating the "
    "broken part>\n"
    "Fix: <NAME=VALUE of the production setting that cleared the spike in replay, or trainer: <the trainer-side "
    "change> where no replay setting can>"
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
            proofs = ", ".join(FAMILY_DOCS[case.family]["proofs"])
            fixes = ", ".join(family_fixes(case.family))
            if case.family in TRAINER_SIDE:
                fixes = f"{fixes}, or the trainer-side change" if fixes else "the trainer-side change"
            where = f"rank {', '.join(map(str, ranks))}" if ranks else "every rank"
            evals.append(
                {
                    "id": len(evals) + 1,
                    "prompt": PROMPT.format(
                        arch=arch, world=MATRIX_WORLD_SIZE, out=out, families=", ".join(FAULT_FAMILIES)
                    ),
                    "expected_output": f"the cause family {case.family} ({where}), shown with the snapshot's figures, "
                    f"proven by a replay experiment ({proofs}), and its fix ({fixes})",
                    "files": [],
                    "expectations": [
                        f"The report's cause family is {case.family}",
                        f"The report names the ranks at fault: {ranks or 'none (every rank)'}",
                        f"The report's proof is a replay of one of {proofs}",
                        f"The report's fix is {fixes}",
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
        fam: {
            **FAMILY_DOCS[fam],
            "fixes": family_fixes(fam),
            "trainer_side": fam in TRAINER_SIDE,
            "trainer_fix": trainer_fix(fam),
            "old_ids": sorted(old for old, new in OLD_FAMILY_IDS.items() if new == fam),
        }
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
