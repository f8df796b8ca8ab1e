"""The fault matrix as skill evals: evals.json is what the generator writes, every eval's snapshot command is one the
CLI accepts, and the scorer reads a report's answer the way the prompt asks for it."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from axrl_spike_replay.capture.reference.presets import FAULT_FAMILIES, PRESETS
from axrl_spike_replay.cli import build_parser
from axrl_spike_replay.cli.capture_commands import _faults
from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS

REPO = Path(__file__).resolve().parents[2]
EVALS = REPO / "skills" / "axrl-spike-replay" / "evals"


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads((EVALS / "evals.json").read_text())


def test_evals_json_is_what_the_generator_writes_in_the_skills_spec_format(doc) -> None:
    generator = load(REPO / "scripts" / "make_skill_evals.py")
    assert (EVALS / "evals.json").read_text() == generator.render(), "run scripts/make_skill_evals.py"
    assert doc["skill_name"] == "axrl-spike-replay" and set(doc["families"]) == set(FAULT_FAMILIES)
    ids = [e["id"] for e in doc["evals"]]
    assert ids == list(range(1, len(ids) + 1))
    for case in doc["evals"]:
        assert {"prompt", "expected_output", "files", "expectations"} <= set(case)
        assert case["expected"]["family"] in FAULT_FAMILIES
    assert {e["snapshot"]["model"] for e in doc["evals"]} >= {"qwen2_moe", "olmoe", "mixtral"}
    assert {e["expected"]["family"] for e in doc["evals"] if e["snapshot"]["provenance"] == "held_out"} >= {
        "stale_old_logprobs", "bad_ref_logprobs", "routing_payload", "engine_mismatch", "non_finite"
    }  # fmt: skip


def test_each_family_s_fixes_are_mitigations(doc) -> None:
    for family, entry in doc["families"].items():
        unknown = set(entry["fixes"]) - set(MITIGATIONS)
        assert not unknown, f"{family}: {unknown}"


def test_every_eval_s_snapshot_command_is_one_the_cli_accepts(doc) -> None:
    parser = build_parser()
    for case in doc["evals"]:
        words = shlex.split(case["snapshot"]["command"])
        assert words[:2] == ["axrl-spike-replay", "capture"]
        args = parser.parse_args(words[1:])
        assert args.hide_fault and args.preset in PRESETS and args.world_size == 2
        _faults(args.fault)  # each --fault builds


REPORT = """# Spike at iteration 20
Rank 1's old log-probs disagree with the replayed policy (max |log pi - log pi_old| 8.9) while rank 0's agree.
Replayed with drop_ranks=1: cleared.

Cause family: stale_old_logprobs
Ranks: 1
Fix: drop_ranks=1
"""


def test_the_scorer_passes_a_right_report_and_names_what_a_wrong_one_missed(doc, tmp_path) -> None:
    score = load(EVALS / "score.py")
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    right = score.score_report(REPORT, case, doc["families"])
    assert right["checks"] == {"cause": True, "ranks": True, "fix": True} and right["score"] == 1.0
    wrong = score.score_report(REPORT.replace("stale_old_logprobs", "engine_mismatch"), case, doc["families"])
    assert wrong["checks"]["cause"] is False and wrong["named"] == "engine_mismatch"
    # no answer lines: the family mentioned first (an earlier cause id counts as its family), fixes anywhere
    free = "Top cause: logprob_mismatch at strength 1.0. Tried mismatch_token_clip_max=2: no effect."
    loose = score.score_report(free, case, doc["families"])
    assert (
        loose["named"] == "engine_mismatch" and loose["ranks"] is None and loose["fixes"] == ["mismatch_token_clip_max"]
    )
    assert loose["score"] == 0.0
    spread = next(e for e in doc["evals"] if e["expected"]["ranks"] == [])
    assert score.score_report("Ranks: none\n", spread, doc["families"])["checks"]["ranks"] is True


def test_the_scorer_command_scores_a_directory_of_reports(doc, tmp_path) -> None:
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    (tmp_path / f"{case['id']}.md").write_text(REPORT)
    run = subprocess.run(
        [sys.executable, str(EVALS / "score.py"), str(EVALS / "evals.json"), str(tmp_path), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    total = json.loads(run.stdout)["total"]
    assert total == {"reports": 1, "cause": 1, "ranks": 1, "fix": 1, "mean_score": 1.0}
    bad = subprocess.run(
        [sys.executable, str(EVALS / "score.py"), str(EVALS / "evals.json"), str(tmp_path), "--eval", "999"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "--eval 999: no such eval" in bad.stderr


def test_a_shotgun_list_of_fixes_fails_the_fix_check_and_only_the_right_fix_passes(doc) -> None:
    score = load(EVALS / "score.py")
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    every = sorted({f for family in doc["families"].values() for f in family["fixes"]})
    assert len(every) == 19
    shotgun = REPORT.replace("Fix: drop_ranks=1", "Fix: " + ", ".join(f"{f}=1" for f in every))
    graded = score.score_report(shotgun, case, doc["families"])
    assert graded["checks"]["fix"] is False and graded["shotgun"] is True and graded["score"] < 1.0
    # without a Fix line, every NAME=VALUE of the report counts: listing them all fails the same way
    loose = score.score_report(REPORT.replace("Fix: drop_ranks=1", " ".join(f"{f}=1" for f in every)), case,
                               doc["families"])  # fmt: skip
    assert loose["checks"]["fix"] is False
    wrong = score.score_report(REPORT.replace("Fix: drop_ranks=1", "Fix: advantage_clip=5"), case, doc["families"])
    assert wrong["checks"]["fix"] is False  # a real mitigation, of another family
    mixed = score.score_report(REPORT.replace("Fix: drop_ranks=1", "Fix: drop_ranks=1 kl_coef=0"), case,
                               doc["families"])  # fmt: skip
    assert mixed["checks"]["fix"] is False  # one right, one wrong: not the right fix
    pair = score.score_report(REPORT.replace("Fix: drop_ranks=1", "Fix: drop_ranks=1 recompute=old_logprobs"), case,
                              doc["families"])  # fmt: skip
    assert pair["checks"]["fix"] is True and pair["fixes"] == ["drop_ranks", "recompute"]
    noted = score.score_report(REPORT.replace("Fix: drop_ranks=1", "Fix: drop_ranks=1 (grad_norm=0.9 after)"), case,
                               doc["families"])  # fmt: skip
    assert noted["checks"]["fix"] is True and noted["fixes"] == ["drop_ranks"]  # grad_norm is no mitigation


class _CountingPattern:
    """A compiled pattern that counts the characters it is handed (the regex engine's work is bounded by them times
    the pattern's own size when the pattern cannot run past its text, which one line is)."""

    def __init__(self, pattern: re.Pattern[str], handed: list[str]) -> None:
        self.pattern, self.handed = pattern, handed

    def match(self, text: str, *args: object) -> re.Match[str] | None:
        self.handed.append(text)
        return self.pattern.match(text, *args)  # type: ignore[arg-type]

    def search(self, text: str, *args: object) -> re.Match[str] | None:
        self.handed.append(text)
        return self.pattern.search(text, *args)  # type: ignore[arg-type]


@pytest.mark.parametrize("blank", ["\n", " \n", "> \n", "*\t\n"])
def test_the_scorer_reads_a_report_in_linear_work(doc, blank: str) -> None:
    """A report of 20,000 blank lines took 5.8 s: each `^[\\s>*_-]*` attempt ran on over every following line break.
    Now each pattern is handed one line at a time: each character and each line go to each of the 3 patterns at most
    once, and ten times the report is at most ten times the work. Counted, never timed."""
    score = load(EVALS / "score.py")
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    handed: list[str] = []
    for name in [n for n in vars(score) if n.endswith("_RE") and n != "_ITEM_RE"]:  # the answer patterns, by any name
        setattr(score, name, _CountingPattern(getattr(score, name), handed))
    if hasattr(score, "_ANSWERS"):
        score._ANSWERS = {k: _CountingPattern(p, handed) for k, p in score._ANSWERS.items()}
    work = []
    for lines in (2_000, 20_000):
        handed.clear()
        report = blank * lines + REPORT
        assert score.score_report(report, case, doc["families"])["score"] == 1.0
        assert handed and not any("\n" in text for text in handed)  # no pattern sees past a line's end
        work.append(sum(len(text) + 1 for text in handed))
        assert work[-1] <= 3 * (len(report) + report.count("\n") + 1)  # each character and each call, once a pattern
    assert work[1] <= 10 * work[0] + 3 * len(REPORT)
