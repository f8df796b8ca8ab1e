"""The fault matrix as skill evals: evals.json is what the generator writes, every eval's snapshot command is one the
CLI accepts, each family's fixes are the production settings the mitigation catalogue advises against it, and the
scorer reads a report's answer (its proof and its fix apart) the way the prompt asks for it."""

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


def test_each_family_s_proofs_and_fixes_are_mitigations(doc) -> None:
    for family, entry in doc["families"].items():
        unknown = (set(entry["proofs"]) | set(entry["fixes"])) - set(MITIGATIONS)
        assert not unknown, f"{family}: {unknown}"


def test_a_family_s_fixes_are_the_catalogue_s_production_settings_for_it_and_never_a_diagnostic(doc) -> None:
    """The fix field is derived from the declarations (the catalogue's advice under the family's symptoms), not from
    answers: no diagnostic lever, hypothesis or replay from other weights is ever a fix, and a family no setting can
    fix (a step that does not reproduce) takes the trainer-side change."""
    from axrl_spike_replay.diagnosis.families import TRAINER_SIDE, family_fixes

    for family, entry in doc["families"].items():
        assert entry["fixes"] == family_fixes(family)
        assert all(MITIGATIONS[name].production for name in entry["fixes"]), family
        assert not {"drop_ranks", "keep_ranks", "drop_samples", "recompute", "loss_scale", "initial_model"} & set(
            entry["fixes"]
        )
        assert entry["trainer_side"] is (family in TRAINER_SIDE)
    assert doc["families"]["step_not_reproduced"]["fixes"] == [] and doc["families"]["one_rank_data"]["fixes"] == []
    # what each fix list holds comes from the symptoms the family shows: the mismatch group for stale old log-probs,
    # the KL group for a routing payload (the catalogue's KL symptom names routes), no KL setting for stale log-probs
    assert "is_base_logprobs" in doc["families"]["stale_old_logprobs"]["fixes"]
    assert "kl_estimator" in doc["families"]["routing_payload"]["fixes"]
    assert "kl_estimator" not in doc["families"]["stale_old_logprobs"]["fixes"]
    assert "balance_negative_advantages" not in doc["families"]["mask_misalignment"]["fixes"]


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
Replayed with drop_ranks=1: cleared; with is_base_logprobs=rollout (the ratio off the stale old log-probs): cleared.

Cause family: stale_old_logprobs
Ranks: 1
Proof: drop_ranks=1
Fix: is_base_logprobs=rollout
"""


def test_the_scorer_passes_a_right_report_and_names_what_a_wrong_one_missed(doc, tmp_path) -> None:
    score = load(EVALS / "score.py")
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    right = score.score_report(REPORT, case, doc["families"])
    assert right["checks"] == {"cause": True, "ranks": True, "proof": True, "fix": True} and right["score"] == 1.0
    wrong = score.score_report(REPORT.replace("stale_old_logprobs", "engine_mismatch"), case, doc["families"])
    assert wrong["checks"]["cause"] is False and wrong["named"] == "engine_mismatch"
    # no answer lines: the family mentioned first (an earlier cause id counts as its family), fixes anywhere
    free = "Top cause: logprob_mismatch at strength 1.0. Tried kl_clamp=10: no effect."
    loose = score.score_report(free, case, doc["families"])
    assert loose["named"] == "engine_mismatch" and loose["ranks"] is None and loose["fixes"] == ["kl_clamp"]
    assert loose["proofs"] == [] and loose["score"] == 0.0  # no Proof line: no proof
    spread = next(e for e in doc["evals"] if e["expected"]["ranks"] == [])
    assert score.score_report("Ranks: none\n", spread, doc["families"])["checks"]["ranks"] is True


def test_the_scorer_reads_the_answer_lines_the_report_ends_with_not_a_heading_of_its_body(doc) -> None:
    score = load(EVALS / "score.py")
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    body = (
        "## Findings\nProof: recomputing rank 1's old log-probs cleared the step (recompute=old_logprobs:rank1 and "
        "is_base_logprobs=rollout both did).\nFix: in the trainer, check rank 1's old log-prob pass.\n\n"
    )
    ended = score.score_report(body + REPORT, case, doc["families"])
    assert ended["proofs"] == ["drop_ranks"] and ended["fixes"] == ["is_base_logprobs"] and ended["score"] == 1.0
    # the body's lines alone, as the answer: two proofs where one is asked, and a fix that names no setting
    alone = score.score_report(body, case, doc["families"])
    assert alone["checks"]["fix"] is False


def test_the_scorer_command_scores_a_directory_of_reports(doc, tmp_path) -> None:
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    (tmp_path / f"{case['id']}.md").write_text(REPORT)
    run = subprocess.run(
        [sys.executable, str(EVALS / "score.py"), str(EVALS / "evals.json"), str(tmp_path), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    total = json.loads(run.stdout)["total"]
    assert total == {"reports": 1, "cause": 1, "ranks": 1, "proof": 1, "fix": 1, "mean_score": 1.0}
    bad = subprocess.run(
        [sys.executable, str(EVALS / "score.py"), str(EVALS / "evals.json"), str(tmp_path), "--eval", "999"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "--eval 999: no such eval" in bad.stderr


def test_a_shotgun_list_of_fixes_fails_the_fix_check_and_only_the_right_fix_passes(doc) -> None:
    score = load(EVALS / "score.py")
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    every = sorted({f for family in doc["families"].values() for f in (*family["proofs"], *family["fixes"])})
    assert len(every) == 27
    fix = "Fix: is_base_logprobs=rollout"
    shotgun = REPORT.replace(fix, "Fix: " + ", ".join(f"{f}=1" for f in every))
    graded = score.score_report(shotgun, case, doc["families"])
    assert graded["checks"]["fix"] is False and graded["shotgun"] is True and graded["score"] < 1.0
    # without a Fix line, every NAME=VALUE of the report counts: listing them all fails the same way
    loose = score.score_report(REPORT.replace(fix, " ".join(f"{f}=1" for f in every)), case, doc["families"])
    assert loose["checks"]["fix"] is False
    wrong = score.score_report(REPORT.replace(fix, "Fix: advantage_clip=5"), case, doc["families"])
    assert wrong["checks"]["fix"] is False  # a real mitigation, of another family
    mixed = score.score_report(REPORT.replace(fix, "Fix: is_base_logprobs=rollout kl_coef=0"), case, doc["families"])
    assert mixed["checks"]["fix"] is False  # one right, one wrong: not the right fix
    pair = score.score_report(REPORT.replace(fix, "Fix: is_base_logprobs=rollout mismatch_token_clip_max=2"), case,
                              doc["families"])  # fmt: skip
    assert pair["checks"]["fix"] is True and pair["fixes"] == ["is_base_logprobs", "mismatch_token_clip_max"]
    noted = score.score_report(REPORT.replace(fix, "Fix: is_base_logprobs=rollout (grad_norm=0.9 after)"), case,
                               doc["families"])  # fmt: skip
    assert noted["checks"]["fix"] is True and noted["fixes"] == ["is_base_logprobs"]  # grad_norm is no mitigation


def test_a_diagnostic_lever_is_a_proof_never_a_fix_and_a_proof_list_of_guesses_fails(doc) -> None:
    score = load(EVALS / "score.py")
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    dropped = score.score_report(REPORT.replace("Fix: is_base_logprobs=rollout", "Fix: drop_ranks=1"), case,
                                 doc["families"])  # fmt: skip
    assert dropped["checks"] == {"cause": True, "ranks": True, "proof": True, "fix": False}
    pair = score.score_report(REPORT.replace("Proof: drop_ranks=1", "Proof: drop_ranks=1 recompute=old_logprobs:rank1"),
                              case, doc["families"])  # fmt: skip
    assert pair["checks"]["proof"] is True and pair["proofs"] == ["drop_ranks", "recompute"]
    guesses = REPORT.replace("Proof: drop_ranks=1", "Proof: drop_ranks=1 keep_ranks=0 recompute=old_logprobs")
    assert score.score_report(guesses, case, doc["families"])["checks"]["proof"] is False  # three: a list of guesses
    other = REPORT.replace("Proof: drop_ranks=1", "Proof: kl_coef=0")
    assert score.score_report(other, case, doc["families"])["checks"]["proof"] is False  # not this family's lever
    unproven = REPORT.replace("Proof: drop_ranks=1\n", "")
    graded = score.score_report(unproven, case, doc["families"])
    assert graded["checks"]["proof"] is False and graded["checks"]["fix"] is True


@pytest.mark.parametrize(
    ("case_name", "setting"),
    [
        ("stale_old_logprobs", "is_base_logprobs=rollout"),
        ("one_rank_routes_shifted", "kl_estimator=k2"),
        ("misaligned_loss_mask", "ratio_outlier_mask=token"),
        ("held_out:engine_neg_inf_logprob", "log_ratio_clip=5"),
    ],
)
def test_a_production_setting_of_the_planted_family_is_a_fix(doc, case_name: str, setting: str) -> None:
    score = load(EVALS / "score.py")
    case = next(e for e in doc["evals"] if e["snapshot"]["case"] == case_name)
    family, ranks = case["expected"]["family"], case["expected"]["ranks"]
    proof = doc["families"][family]["proofs"][0]
    report = (
        f"Cause family: {family}\nRanks: {', '.join(map(str, ranks)) or 'none'}\nProof: {proof}=1\nFix: {setting}\n"
    )
    assert score.score_report(report, case, doc["families"])["checks"]["fix"] is True
    elsewhere = "balance_negative_advantages=true"  # a real production setting of another family
    assert score.score_report(report.replace(setting, elsewhere), case, doc["families"])["checks"]["fix"] is False


def test_a_trainer_side_fix_passes_only_where_no_replay_setting_undoes_the_family(doc) -> None:
    score = load(EVALS / "score.py")
    scaled = next(e for e in doc["evals"] if e["snapshot"]["case"] == "one_rank_loss_scale")
    trainer = (
        "Cause family: step_not_reproduced\nRanks: 1\nProof: loss_scale=2@1\n"
        "Fix: trainer: rank 1's loss is 2x the recorded config's (loss_scale=2@1 reproduces the step); check where "
        "the trainer normalises rank 1's loss\n"
    )
    graded = score.score_report(trainer, scaled, doc["families"])
    assert graded["trainer_side"] is True and graded["checks"] == {"cause": True, "ranks": True, "proof": True,
                                                                   "fix": True}  # fmt: skip
    # no replay setting undoes a trainer-side scale: a setting named as its fix fails, as does another family's
    assert score.score_report(trainer.replace("Fix: trainer: rank 1's", "Fix: log_ratio_clip=5; rank 1's"), scaled,
                              doc["families"])["checks"]["fix"] is False  # fmt: skip
    assert score.score_report(trainer.replace("(loss_scale=2@1", "(kl_coef=0"), scaled,
                              doc["families"])["checks"]["fix"] is False  # fmt: skip
    # where a setting clears the family's spike in replay, the trainer-side change is not the fix the prompt asks for
    stale = next(e for e in doc["evals"] if e["snapshot"]["case"] == "stale_old_logprobs")
    moved = REPORT.replace("Fix: is_base_logprobs=rollout", "Fix: trainer: recompute old log-probs at the weights")
    assert score.score_report(moved, stale, doc["families"])["checks"]["fix"] is False


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
    Now each pattern is handed one line at a time: each character and each line go to each of the patterns at most
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
        # each character and each call, once a pattern
        assert work[-1] <= len(score._ANSWERS) * (len(report) + report.count("\n") + 1)
    assert work[1] <= 10 * work[0] + len(score._ANSWERS) * len(REPORT)


def test_a_mask_built_wrong_is_fixed_where_the_trainer_builds_it(doc) -> None:
    """A rank that passes 1/length token weights as its loss mask: no replay setting rebuilds a mask, so the fix is
    the trainer-side change the family's doc writes out, and a report that names it passes."""
    score = load(EVALS / "score.py")
    family = doc["families"]["mask_misalignment"]
    assert family["trainer_side"] is True and "0/1 mask" in family["trainer_fix"]
    case = next(e for e in doc["evals"] if e["expected"]["family"] == "mask_misalignment")
    ranks = ", ".join(map(str, case["expected"]["ranks"])) or "none"
    report = (
        f"Cause family: mask_misalignment\nRanks: {ranks}\nProof: drop_ranks={ranks}\n"
        "Fix: trainer: build the loss mask as 0/1 over the response tokens, not 1/length weights\n"
    )
    assert score.score_report(report, case, doc["families"])["checks"]["fix"] is True
    assert all(doc["families"][f]["trainer_fix"] for f in doc["families"] if doc["families"][f]["trainer_side"])
