#!/usr/bin/env python3
"""Score an agent's spike report against an eval of `evals.json` (standard library only).

A report answers with four lines (the eval's prompt asks for them):

    Cause family: <one family id of evals.json's `families`>
    Ranks: <the data-parallel ranks at fault, comma-separated, or none>
    Proof: <NAME=VALUE of the replay experiment that moved or cleared the spike, proving the cause>
    Fix: <NAME=VALUE of the production setting that cleared it in replay, or `trainer: <the change>`>

A report without a `Cause family:` line is read for the family whose words it mentions first (an earlier cause id,
such as `logprob_mismatch`, counts as the family it stood for). Four checks, each pass or fail:

- `cause`: the family named is the planted one;
- `ranks`: the ranks named are the ones the fault hit (a fault on every rank: the report names none);
- `proof`: the experiments named on the `Proof:` line are at most MAX_FIXES, every one of them of the planted
  family's `proofs` (the levers that remove or isolate its broken part: a drop, a recompute, the family's own setting);
- `fix`: the settings named on the `Fix:` line (or, without one, anywhere as NAME=VALUE) are at most MAX_FIXES, every
  one of them of the planted family's `fixes`: the production settings the mitigation catalogue advises against the
  family's symptoms (a diagnostic lever such as drop_ranks is a proof, never a fix). A line that opens with
  `trainer` is the trainer-side change: it passes only for a family whose fix may be one (`trainer_side`: a step
  that does not reproduce, a non-finite value, one rank's data), naming nothing outside that family's proofs and
  fixes (`loss_scale=2@1`, the factor a step-not-reproduced fix reports, is its proof).

Only names of evals.json's proofs and fixes count as mitigations. A report that lists many (`shotgun`) fails the
check however many of them are right.

Each answer line is found by matching one line at a time (`answer_lines`), so the work is linear in the report's
length whatever it holds (a pattern anchored at every line start that could run on past line breaks once made
20,000 blank lines quadratic).

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

# Matched against one line at a time (never across a line break), from the line's start: markdown quote, bullet
# and emphasis marks, then the label, then the answer.
_ANSWERS = {
    "cause": re.compile(r"[ \t>*_-]*cause(?: family)?[*_]*[ \t]*:[*_ \t]*`?([A-Za-z_]+)`?", re.IGNORECASE),
    "ranks": re.compile(r"[ \t>*_-]*ranks?[*_]*[ \t]*:[*_ \t]*(.*)", re.IGNORECASE),
    "proof": re.compile(r"[ \t>*_-]*proofs?[*_]*[ \t]*:[*_ \t]*(.*)", re.IGNORECASE),
    "fix": re.compile(r"[ \t>*_-]*fix(?:es)?[*_]*[ \t]*:[*_ \t]*(.*)", re.IGNORECASE),
}
_TRAINER_RE = re.compile(r"[`*_ \t]*trainer\b", re.IGNORECASE)  # a Fix line naming the trainer-side change
_ITEM_RE = re.compile(r"\b([a-z][a-z0-9_]*)=")
MAX_FIXES = 2  # a fix and at most one companion (a mitigation set); more is a list of guesses


def answer_lines(report: str) -> dict[str, str]:
    """The answer of each last `Cause family:`, `Ranks:`, `Proof:` and `Fix:` line, by label (absent: no such
    line): the prompt asks the report to end with them, and its body may use the same words as headings."""
    found: dict[str, str] = {}
    for line in report.splitlines():
        for label, pattern in _ANSWERS.items():
            if match := pattern.match(line):
                found[label] = match.group(1)
    return found


def declared_family(report: str, families: dict[str, Any], answers: dict[str, str] | None = None) -> str | None:
    """The family the report names: its `Cause family:` line, else the family whose words appear first."""
    aliases = {old: fam for fam, doc in families.items() for old in doc.get("old_ids", [])}
    named = (answer_lines(report) if answers is None else answers).get("cause")
    if named is not None:
        name = named.lower()
        return aliases.get(name, name)
    text = report.lower()
    first: tuple[int, str] | None = None
    for fam, doc in families.items():
        for word in [fam, *doc.get("old_ids", []), *doc.get("words", [])]:
            at = text.find(word.lower())
            if at >= 0 and (first is None or at < first[0]):
                first = (at, fam)
    return first[1] if first else None


def declared_ranks(report: str, answers: dict[str, str] | None = None) -> list[int] | None:
    """The ranks of the `Ranks:` line ([] for none / all / every), None without the line."""
    line = (answer_lines(report) if answers is None else answers).get("ranks")
    if line is None:
        return None
    return sorted({int(n) for n in re.findall(r"\d+", line) if len(n) <= 9})  # no rank has 10 digits


def declared_fixes(report: str, known: set[str] | None = None, answers: dict[str, str] | None = None) -> list[str]:
    """Mitigation names of the `Fix:` line, else of every NAME=VALUE in the report, each once in order; with
    `known`, only those names (a `grad_norm=3.1` beside the fix is no mitigation)."""
    line = (answer_lines(report) if answers is None else answers).get("fix")
    names = _ITEM_RE.findall(report if line is None else line)
    return [n for n in dict.fromkeys(names) if known is None or n in known]


def declared_proofs(report: str, known: set[str] | None = None, answers: dict[str, str] | None = None) -> list[str]:
    """Mitigation names of the `Proof:` line, each once in order ([] without the line); with `known`, only those."""
    line = (answer_lines(report) if answers is None else answers).get("proof")
    names = _ITEM_RE.findall(line or "")
    return [n for n in dict.fromkeys(names) if known is None or n in known]


def trainer_side(report: str, answers: dict[str, str] | None = None) -> bool:
    """Whether the `Fix:` line names the trainer-side change (it opens with `trainer`)."""
    line = (answer_lines(report) if answers is None else answers).get("fix")
    return line is not None and _TRAINER_RE.match(line) is not None


def score_report(report: str, case: dict[str, Any], families: dict[str, Any]) -> dict[str, Any]:
    """The four checks of one report against its eval, and the fraction passed."""
    expected = case["expected"]
    answers = answer_lines(report)  # one pass over the report's lines
    family = declared_family(report, families, answers)
    ranks = declared_ranks(report, answers)
    known = {f for doc in families.values() for f in (*doc["proofs"], *doc["fixes"])}
    proofs = declared_proofs(report, known, answers)
    fixes = declared_fixes(report, known, answers)
    trainer = trainer_side(report, answers)
    doc = families[expected["family"]]
    shotgun = len(fixes) > MAX_FIXES or len(proofs) > MAX_FIXES
    if trainer:  # the trainer-side change: only where no replay setting may undo the family's broken part
        fix = bool(doc["trainer_side"]) and all(f in doc["proofs"] or f in doc["fixes"] for f in fixes)
    else:
        fix = bool(fixes) and all(f in doc["fixes"] for f in fixes)
    checks = {
        "cause": family == expected["family"],
        "ranks": ranks is not None and ranks == sorted(expected["ranks"]),
        "proof": bool(proofs) and not shotgun and all(p in doc["proofs"] for p in proofs),
        "fix": fix and not shotgun,
    }
    return {
        "id": case["id"],
        "expected": expected["family"],
        "named": family,
        "ranks": ranks,
        "proofs": proofs,
        "fixes": fixes,
        "trainer_side": trainer,
        "shotgun": shotgun,
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
        "proof": sum(s["checks"]["proof"] for s in scores),
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
            f"{n} reports: cause {total['cause']}/{n}, ranks {total['ranks']}/{n}, proof {total['proof']}/{n}, "
            f"fix {total['fix']}/{n}, "
            f"mean score {total['mean_score']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
