"""Print the verl cross-check table: each setting's loss (summed over the 2 ranks) with our verl convention and
with verl 0.9.1's own functions, and the worst relative difference of loss and gradient (seed 0).

Run: PYTHONPATH=mcp_server python scripts/verl_crosscheck_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "training"))

from verl_cases import CASES, compare
from verl_peer import load_verl


def main() -> None:
    peer = load_verl()
    print(f"verl {peer['version']}, float64, 2 DP ranks")
    print(f"| {'setting':<48} | {'ours':>22} | {'verl':>22} | loss rel diff | grad rel diff |")
    print(f"|{'-' * 50}|{'-' * 24}|{'-' * 24}|---------------|---------------|")
    for name, case in CASES.items():
        f = compare(case, peer)
        ours, theirs = f"{f['ours']:>22.16g}", f"{f['verl']:>22.16g}"
        print(f"| {name:<48} | {ours} | {theirs} | {f['loss_rel']:13.2e} | {f['grad_rel']:13.2e} |")


if __name__ == "__main__":
    main()
