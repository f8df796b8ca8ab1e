"""Print the TRL cross-check table: each setting's loss (summed over the processes) with our trl convention and
with TRL 1.16's own `GRPOTrainer._compute_loss`, and the worst relative difference of loss and gradient over the
5 seeds of the test.

Run: PYTHONPATH=mcp_server python scripts/trl_crosscheck_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "training"))

from trl_cases import CASES, GA, PROCESSES, SEEDS, compare


def main() -> None:
    import trl

    print(f"TRL {trl.__version__}, float64, {PROCESSES} processes x {GA} micro-batches unless named, seeds {SEEDS}")
    print(f"| {'setting':<55} | {'ours (seed 0)':>20} | {'TRL (seed 0)':>20} | loss rel diff | grad rel diff |")
    print(f"|{'-' * 57}|{'-' * 22}|{'-' * 22}|---------------|---------------|")
    worst = 0.0
    for name, case in CASES.items():
        runs = [compare(case, seed) for seed in SEEDS]
        loss_rel = max(f["loss_rel"] for f in runs)
        grad_rel = max(f["grad_rel"] for f in runs)
        worst = max(worst, loss_rel, grad_rel)
        ours, theirs = f"{runs[0]['ours']:>20.14g}", f"{runs[0]['trl']:>20.14g}"
        print(f"| {name:<55} | {ours} | {theirs} | {loss_rel:13.2e} | {grad_rel:13.2e} |")
    print(f"\nworst relative difference over every setting and seed: {worst:.2e}")


if __name__ == "__main__":
    main()
