#!/usr/bin/env python3
"""Score an agent's spike report against an eval of `evals.json` (standard library only).

A report answers with three lines (the eval's prompt asks for them):

    Cause family: <one family id of evals.json's `families`>
    Ranks: <the data-parallel ranks at fault, comma-separated, or none>
    Fix: <NAME=VALUE of the mitigation that cleared the spike in replay>

A report without a `Cause family:` line is read for the family whose words it mentions first (an earlier cause id,
such as `logprob_mismatch`, counts as the family it stood for). Three checks, each pass or fail:

- `cause`: the family named is the planted one;
- `ranks`: the ranks named are the ones the fault hit (a fault on every rank: the report names none);
- `fix`: a mitigation named on the `Fix:` line (or, without one, anywhere as NAME=VALUE) is of the planted
  family's fixes.

Usage:
    score.py evals.json REPORT_DIR [--json]    # REPORT_DIR/<id>.md for each eval that has a report
    score.py evals.json --eval ID REPORT.md    # one report
Run it on the reports of an agent with the skill and of one without to measure what the skill adds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

_CAUSE_RE = re.compile(r"^[\s>*_-]*cause(?: family)?[*_]*\s*:[*_\s]*`?([A-Za-z_]+)`?", re.IGNORECASE | re.MULTILINE)
_RANKS_RE = re.compile(r"^[\s>*_-]*ranks?[*_]*\s*:[*_\s]*(.*)$", re.IGNORECASE | re.MULTILINE)
_FIX_RE = re.compile(r"^[\s>*_-]*fix(?:es)?[*_]*\s*:[*_\s]*(.*)$", re.IGNORECASE | re.MULTILINE)
_ITEM_RE = re.compile(r"\b([a-z][a-z0-9_]*)=")


def declared_family(report: str, families: dict[str, Any]) -> str | None:
    """The family the report names: its `Cause family:` line, else the family whose words appear first."""
    aliases = {old: fam for fam, doc in families.items() for old in doc.get("old_ids", [])}
    match = _CAUSE_RE.search(report)
    if match:
        name = match.group(1).lower()
        return aliases.get(name, name)
    text = report.lower()
    first: tuple[int, str] | None = None
    for fam, doc in families.items():
        for word in [fam, *doc.get("old_ids", []), *doc.get("words", [])]:
            at = text.find(word.lower())
            if at >= 0 and (first is None or at < first[0]):
                first = (at, fam)
    return first[1] if first else None


def declared_ranks(report: str) -> list[int] | None:
    """The ranks of the `Ranks:` line ([] for none / all / every), None without the line."""
    match = _RANKS_RE.search(report)
    if not match:
        return None
    return sorted({int(n) for n in re.findall(r"\d+", match.group(1))})


def declared_fixes(report: str) -> list[str]:
    """Mitigation names of the `Fix:` line, else of every NAME=VALUE in the report."""
    match = _FIX_RE.search(report)
    return _ITEM_RE.findall(match.group(1) if match else report)


def score_report(report: str, case: dict[str, Any], families: dict[str, Any]) -> dict[str, Any]:
    """The three checks of one report against its eval, and the fraction passed."""
    expected = case["expected"]
    family = declared_family(report, families)
    ranks = declared_ranks(report)
    fixes = declared_fixes(report)
    good_fixes = set(families[expected["family"]]["fixes"])
    checks = {
        "cause": family == expected["family"],
        "ranks": ranks is not None and ranks == sorted(expected["ranks"]),
        "fix": any(f in good_fixes for f in fixes),
    }
    return {
        "id": case["id"],
        "expected": expected["family"],
        "named": family,
        "ranks": ranks,
        "fixes": fixes,
        "checks": checks,
        "score": sum(checks.values()) / len(checks),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="score spike reports against evals.json")
    ap.add_argument("evals", type=Path)
    ap.add_argument("reports", type=Path, help="a directory of <id>.md reports, or one report with --eval")
    ap.add_argument("--eval", type=int, default=None, metavar="ID", help="score one report against this eval")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    doc = json.loads(args.evals.read_text(encoding="utf-8"))
    by_id = {case["id"]: case for case in doc["evals"]}
    if args.eval is not None:
        if args.eval not in by_id:
            ap.error(f"--eval {args.eval}: no such eval in {args.evals}")
        pairs = [(by_id[args.eval], args.reports)]
    else:
        if not args.reports.is_dir():
            ap.error(f"{args.reports}: not a directory (give --eval ID to score one report)")
        pairs = [(by_id[i], args.reports / f"{i}.md") for i in sorted(by_id) if (args.reports / f"{i}.md").is_file()]
    scores = [score_report(path.read_text(encoding="utf-8"), case, doc["families"]) for case, path in pairs]
    total = {
        "reports": len(scores),
        "cause": sum(s["checks"]["cause"] for s in scores),
        "ranks": sum(s["checks"]["ranks"] for s in scores),
        "fix": sum(s["checks"]["fix"] for s in scores),
        "mean_score": sum(s["score"] for s in scores) / len(scores) if scores else 0.0,
    }
    if args.json:
        print(json.dumps({"scores": scores, "total": total}, indent=1))
    else:
        for s in scores:
            marks = " ".join(f"{k}:{'ok' if v else 'no'}" for k, v in s["checks"].items())
            print(f"eval {s['id']:3d}  expected {s['expected']:28s} named {s['named'] or '-':28s} {marks}")
        n = total["reports"]
        print(
            f"{n} reports: cause {total['cause']}/{n}, ranks {total['ranks']}/{n}, fix {total['fix']}/{n}, "
            f"mean score {total['mean_score']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
