#!/usr/bin/env python3
"""`diagnose` over the fault matrix: how often it names the planted cause first, and what its suggestions do.

Every case of `testing.fault_matrix` (one preset per cause family, variants, and held-out faults no preset uses) is
captured by the reference trainer with the fault hidden from the snapshot, on each model and seed asked for. The
first snapshot at the burst is diagnosed as an agent would (`diagnose_snapshot(model="auto")`), then every
suggested experiment is replayed in one sweep beside the baseline. Printed per case and in total:

- top-1: the strongest cause's family is the planted one (earlier cause ids are read as their family);
- ranks: the ranks the top cause names against those the fault hit (`-` when the fault hit every rank);
- calibration: accuracy per band of the top cause's strength (a strength of 1.0 should be right every time), and
  every cause at strength >= 0.8, not only the first: right when it names the planted family and no rank the faults
  did not hit (a rank-own cause that names every rank, or none, against a fault on some ranks is wrong);
- right rank named: the top cause's ranks are exactly the ranks the faults hit (none named for a fault on every rank);
- experiments: the fraction that clear the spike, that clear or move it (grad norm changed by >= 1 %), and the
  no-ops (grad norm unchanged within the replay tolerance; goal: 0);
- experiment proves the cause: a replay that settles the planted family: one of the suggestions clears the spike, or,
  for a step that does not reproduce, a hypothesis replay reproduces it, or the top cause's prediction of the
  recorded grad norm from the replay's per-rank gradients holds (within the replay tolerance).

`--provenance unseen` runs the faults written before the rules that read them (each on its own model and world
size): the first held-out figure, spent since (rules were written after seeing it). `--provenance held_out_ii` runs
the second held-out set (`capture.fault_injection.held_out_faults`: six kinds no preset and no earlier held-out case
uses, two architectures, world sizes 2 and 4, one case with two faults on two ranks), committed before any rule was
run on it, spent since. `--provenance held_out_iii` runs the third (`capture.fault_injection.held_out_iii_faults`:
eight kinds no earlier provenance uses, tiny_moe and qwen2_moe, world sizes 2 and 4, one case with two faults on two
ranks), committed before `diagnose` was run on it, spent since. `--provenance held_out_iv` runs the fourth
(`capture.fault_injection.held_out_iv_faults`: ten kinds no earlier provenance uses, eleven cases on tiny_moe and
qwen2_moe, world sizes 2 and 4, one case with two faults on two ranks), committed before `diagnose` was run on it,
spent since. `--provenance held_out_v` runs the fifth (`capture.fault_injection.held_out_v_faults`: eight kinds no
earlier provenance uses, three of them in the trainer's loss, twelve cases on tiny_moe, qwen2_moe and olmoe, world
sizes 2 and 4, one case with two faults on two ranks), committed before `diagnose` was run on it, spent since.
`--provenance held_out_vi` runs the sixth (`capture.fault_injection.held_out_vi_faults`: eight kinds no earlier
provenance uses, ten cases on tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with two faults on
two ranks), committed before `diagnose` was run on it, spent since. `--provenance held_out_vii` runs the seventh
(`capture.fault_injection.held_out_vii_faults`: eight kinds no earlier provenance uses, two of them in what the
trainer does with a clean input, eleven cases on tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with
two faults on two ranks), committed before `diagnose` was run on it, spent since. `--provenance held_out_viii` runs
the eighth (`capture.fault_injection.held_out_viii_faults`: eight kinds no earlier provenance uses, two of them in
what the trainer does with a clean input, twelve cases on tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one
case with two faults on two ranks), committed before `diagnose` was run on it, spent since (rules were written after
seeing its two misses). `--provenance held_out_ix` runs the ninth (`capture.fault_injection.held_out_ix_faults`: six
kinds no earlier provenance uses, three of them in what the trainer does with a clean input, thirteen cases on
tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with two faults on two ranks), committed before
`diagnose` was run on it, spent since (rules were written after seeing its misses). `--provenance held_out_x` runs
the tenth (`capture.fault_injection.held_out_x_faults`: six kinds no earlier provenance uses, two of them in what the
trainer does with a clean input, thirteen cases on tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with
two faults on two ranks), committed before `diagnose` was run on it: the held-out figure now.

A case whose run trips no spike guard at the burst is listed as `no spike` and left out of the accuracy: that is the
fault's failure to spike on that model and seed, not the diagnosis's.

Usage: .venv/bin/python benchmarks/bench_diagnosis.py [--models tiny_moe,qwen2_moe,olmoe] [--seeds 0]
       [--provenance preset,variant,held_out,unseen,held_out_ii,...,held_out_x] [--cases NAME,...]
       [--no-experiments] [--json PATH] [--keep DIR [--reuse]]
       (--keep keeps the captures; --reuse diagnoses kept ones again after a change)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.testing.fault_matrix import (
    PROVENANCES,
    MatrixCase,
    burst_snapshots,
    capture_case,
    family_id,
    matrix_cases,
)
from axrl_spike_replay.vocabulary import Verb

BANDS = ((0.0, 0.5), (0.5, 0.8), (0.8, 1.0), (1.0, 1.01))  # strength bands of the calibration table
NO_OP = 1e-6  # |grad norm / baseline - 1| below this: the experiment changed nothing
MOVED = 0.01  # ... at or above this: it moved the spike (experiment.verdict.MEASURABLE_DROP)


@dataclass
class CaseRun:
    """One case on one model and seed: what was planted, what diagnose said, what its experiments did."""

    case: str
    provenance: str
    model: str
    seed: int
    planted: str
    expected_ranks: list[int]
    spiked: bool = False
    iteration: int | None = None
    spike_ratio: float | None = None
    top: str | None = None  # the top cause's family
    top_raw: str | None = None  # ... as diagnose named it
    strength: float | None = None
    ranks_named: list[int] | None = None
    samples_named: list[Any] = field(default_factory=list)
    runner_up: str | None = None
    planted_position: int | None = None  # 1-based position of the planted family among the causes (None: absent)
    experiments: list[dict[str, Any]] = field(default_factory=list)
    hypotheses: list[dict[str, Any]] = field(default_factory=list)  # the diagnosis's hypothesis replays, run
    prediction: dict[str, Any] | None = None  # the top cause's predicted recorded grad norm, when it makes one
    causes: list[dict[str, Any]] = field(default_factory=list)  # every cause: family, strength, ranks named
    world_size: int = 2
    error: str | None = None
    seconds: float = 0.0

    @property
    def correct(self) -> bool:
        return self.top == self.planted

    @property
    def right_rank(self) -> bool:
        """The top cause names exactly the ranks hit (none for a fault on every rank)."""
        return (self.ranks_named or []) == self.expected_ranks

    def cause_right(self, cause: dict[str, Any]) -> bool:
        """A cause names the planted family and no rank the faults did not hit (some rank, when they hit some)."""
        if cause["family"] != self.planted:
            return False
        named = cause.get("ranks") or []
        if not self.expected_ranks:
            return not named
        return bool(named) and set(named) <= set(self.expected_ranks)

    @property
    def strong_wrong(self) -> list[dict[str, Any]]:
        """The causes at strength >= 0.8 that are not right."""
        return [c for c in self.causes if c["strength"] >= 0.8 and not self.cause_right(c)]

    @property
    def proved(self) -> bool:
        """A replay settles the planted family (see the module doc)."""
        if not self.correct:
            return False
        if self.planted == "step_not_reproduced":
            if any(h.get("verdict") == "reproduced" for h in self.hypotheses):
                return True
            # an exact prediction that holds (bounds, where a rank has no scale to apply, prove nothing)
            return bool(
                self.prediction and self.prediction.get("holds") and self.prediction.get("predicted") is not None
            )
        return any(e.get("verdict") == "cleared" for e in self.experiments)


def _ranks_named(cause: Any) -> list[int] | None:
    ranks = getattr(cause, "ranks", None)
    if ranks is not None:
        return sorted(int(r) for r in ranks)
    rank = (getattr(cause, "figures", None) or {}).get("rank")
    return [int(rank)] if isinstance(rank, int) else None


def _samples_named(cause: Any, diagnosis: Any) -> list[Any]:
    samples = getattr(cause, "samples", None)
    if samples:
        return [list(s) for s in samples][:5]
    return [[row["rank"], row["sample"]] for row in (getattr(diagnosis, "attribution_top", None) or [])[:3]]


def _experiments(snapshot: Path, mitigations: list[str]) -> list[dict[str, Any]]:
    """Replay every suggestion beside one baseline (a sweep); each one's verdict and change vs the baseline."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
    from axrl_spike_replay.replay.sweep import run_sweep

    rows: list[dict[str, Any]] = []
    configs: list[dict[str, Any]] = []
    for item in mitigations:
        try:
            configs.append(parse_mitigation_args([item]))
            rows.append({"mitigation": item})
        except AxrlError as exc:
            rows.append({"mitigation": item, "error": str(exc)})
    if not configs:
        return rows
    try:
        sweep = run_sweep(replay_request(What(snapshot, verb=Verb.SWEEP, configs=tuple(configs))))
    except AxrlError as exc:
        for row in rows:
            row.setdefault("error", f"sweep failed: {exc}")
        return rows
    results = iter(sweep.results)
    base = sweep.baseline.grad_norm
    for row in rows:
        if "error" in row:
            continue
        result = next(results)
        change = None
        if result.grad_norm is not None and base and math.isfinite(base) and math.isfinite(result.grad_norm):
            change = result.grad_norm / base - 1.0
        row.update(verdict=str(result.verdict), change=change, error=result.error)
    return rows


def _hypotheses(snapshot: Path, items: list[str]) -> list[dict[str, Any]]:
    """Replay each hypothesis on its own (a hypothesis replay is judged against the recording, not a baseline)."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
    from axrl_spike_replay.replay.engine import run_replay

    rows: list[dict[str, Any]] = []
    for item in items:
        try:
            result = run_replay(replay_request(What(snapshot, mitigations=parse_mitigation_args([item]))))
            rows.append({"mitigation": item, "verdict": str(result.verdict), "grad_norm": result.grad_norm})
        except AxrlError as exc:
            rows.append({"mitigation": item, "error": str(exc)})
    return rows


def kept_snapshots(case_dir: Path) -> list[Path]:
    """The snapshots a kept capture took at its burst (its run config names the burst), the largest spike first, as a
    fresh capture's (`fault_matrix.largest_spike_first`): `--reuse` diagnoses the snapshot a fresh run would."""
    import yaml

    from axrl_spike_replay.testing.fault_matrix import largest_spike_first

    taken = sorted(case_dir.glob("*/checkpoints/spike_snapshots/iter_*"))
    if not taken:
        return []
    burst = (yaml.safe_load((taken[0] / "run_config.yaml").read_text())["train"] or {}).get("burst") or ()
    return largest_spike_first(taken, burst)


def run_case(case: MatrixCase, model: str, seed: int, root: Path, experiments: bool, reuse: bool = False) -> CaseRun:
    """Capture (or, with `reuse`, take the kept capture under `root`), diagnose and optionally test the suggestions
    of one case."""
    from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
    from axrl_spike_replay.snapshot.metadata import read_metadata

    started = time.perf_counter()
    world = case.world_size
    out = CaseRun(case.name, case.provenance, model, seed, case.family, case.expected_ranks(world), world_size=world)
    case_dir = root / f"{case.name.replace(':', '-')}-{model}-s{seed}"
    try:
        if reuse and case_dir.is_dir():
            snapshots = kept_snapshots(case_dir)
        else:
            snapshots = burst_snapshots(capture_case(case, case_dir, model=model, seed=seed), case.preset)
        if not snapshots:
            return out
        snapshot = snapshots[0]
        meta, _ = read_metadata(snapshot)
        out.spiked, out.iteration, out.spike_ratio = True, meta.iteration, meta.spike_ratio
        diagnosis = diagnose_snapshot(snapshot, model="auto")
        families = [family_id(c.family) for c in diagnosis.causes]
        top = diagnosis.causes[0]
        out.top, out.top_raw, out.strength = families[0], top.family, float(top.strength)
        out.runner_up = families[1] if len(families) > 1 else None
        out.planted_position = families.index(case.family) + 1 if case.family in families else None
        out.ranks_named = _ranks_named(top)
        out.causes = [
            {"family": family_id(c.family), "strength": float(c.strength), "ranks": _ranks_named(c)}
            for c in diagnosis.causes
        ]
        out.samples_named = _samples_named(top, diagnosis)
        figures = top.figures or {}
        if "predicted_grad_norm" in figures:
            out.prediction = {
                "predicted": figures.get("predicted_grad_norm"),
                "recorded": figures.get("recorded_grad_norm"),
                "holds": figures.get("prediction_holds"),
            }
        if experiments:
            out.experiments = _experiments(snapshot, [e.mitigation for e in diagnosis.next_steps])
            hypotheses = [e.mitigation for e in getattr(diagnosis, "hypotheses", [])][:4]
            out.hypotheses = _hypotheses(snapshot, hypotheses)
    except Exception as exc:  # a benchmark reports a failing case and goes on
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.seconds = time.perf_counter() - started
    return out


def _pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.0f} %)" if d else "0/0"


def report(runs: list[CaseRun]) -> dict[str, Any]:
    """Print the per-case table and the totals; the totals as a document."""
    print(f"{'case':40s} {'model':11s} s {'planted':28s} {'top (strength)':36s} ranks   named   exps")
    for r in runs:
        if r.error:
            top = f"ERROR {r.error[:60]}"
        elif not r.spiked:
            top = "no spike at the burst"
        else:
            mark = "ok " if r.correct else "MISS"
            top = f"{mark} {r.top} ({r.strength:.2f})"
        exps = ""
        if r.experiments:
            cleared = sum(e.get("verdict") == "cleared" for e in r.experiments)
            exps = f"{cleared}/{len(r.experiments)} clear"
        print(
            f"{r.case:40s} {r.model:11s} {r.seed} {r.planted:28s} {top:36s} "
            f"{r.expected_ranks or '-'!s:7s} {r.ranks_named if r.ranks_named is not None else '-'!s:7s} {exps}"
            + (" proved" if r.proved else "")
        )
    judged = [r for r in runs if r.spiked and not r.error]
    correct = [r for r in judged if r.correct]
    print()
    print(
        f"cases: {len(runs)}; spiked at the burst and diagnosed: {len(judged)}; no spike: "
        f"{sum(not r.spiked and not r.error for r in runs)}; errors: {sum(bool(r.error) for r in runs)}"
    )
    print(f"top-1 accuracy: {_pct(len(correct), len(judged))}")
    by: dict[str, Counter[str]] = defaultdict(Counter)
    for r in judged:
        for key in (f"provenance {r.provenance}", f"model {r.model}", f"family {r.planted}"):
            by[key]["n"] += 1
            by[key]["ok"] += r.correct
    for key in sorted(by):
        print(f"  {key:44s} {_pct(by[key]['ok'], by[key]['n'])}")
    in_top3 = sum(1 for r in judged if r.planted_position is not None and r.planted_position <= 3)
    print(f"planted family among the top 3 causes: {_pct(in_top3, len(judged))}")
    print("calibration (top cause's strength -> accuracy):")
    calibration = []
    for low, high in BANDS:
        band = [r for r in judged if r.strength is not None and low <= r.strength < high]
        ok = sum(r.correct for r in band)
        label = "1.0" if low == 1.0 else f"[{low:.1f}, {high:.1f})"
        print(f"  {label:12s} {_pct(ok, len(band))}")
        calibration.append({"band": label, "n": len(band), "correct": ok})
    ranked = [r for r in judged if r.expected_ranks]
    rank_ok = sum(r.ranks_named == r.expected_ranks for r in ranked)
    print(f"faulty rank named by the top cause (one-rank faults): {_pct(rank_ok, len(ranked))}")
    right_rank = sum(r.right_rank for r in judged)
    print(f"right rank named (the ranks hit, none for every rank): {_pct(right_rank, len(judged))}")
    proved = sum(r.proved for r in judged)
    print(f"experiment proves the cause: {_pct(proved, len(judged))}")
    strong = [r for r in judged if r.strength is not None and r.strength >= 0.8]
    print(f"top causes at strength >= 0.8 that are right: {_pct(sum(r.correct for r in strong), len(strong))}")
    every = [(r, c) for r in judged for c in r.causes if c["strength"] >= 0.8]
    every_ok = sum(r.cause_right(c) for r, c in every)
    clean = sum(not r.strong_wrong for r in judged)
    print(
        "every cause at strength >= 0.8 right (family, and no rank the faults did not hit): "
        f"{_pct(every_ok, len(every))}; cases with no wrong cause at >= 0.8: {_pct(clean, len(judged))}"
    )
    for r in judged:
        for c in r.strong_wrong:
            print(f"  wrong at >= 0.8: {r.case}: {c['family']} {c['strength']:.2f} ranks {c['ranks']}")
    exps = [e for r in judged for e in r.experiments if "error" not in e or e.get("verdict")]
    cleared = sum(e.get("verdict") == "cleared" for e in exps)
    moved = sum(
        e.get("verdict") == "cleared" or (e.get("change") is not None and abs(e["change"]) >= MOVED) for e in exps
    )
    no_ops = [
        (r.case, r.model, e["mitigation"])
        for r in judged
        for e in r.experiments
        if e.get("change") is not None and abs(e["change"]) < NO_OP
    ]
    failed = [(r.case, e["mitigation"], e.get("error")) for r in judged for e in r.experiments if e.get("error")]
    if exps:
        print(
            f"suggested experiments: {len(exps)}; clear the spike {_pct(cleared, len(exps))}; "
            f"clear or move it {_pct(moved, len(exps))}; no-ops {len(no_ops)} (goal 0)"
        )
        for case, model, item in no_ops:
            print(f"  no-op: {item} on {case} ({model})")
        for case, item, error in failed:
            print(f"  failed: {item} on {case}: {error}")
    misses = [r for r in judged if not r.correct]
    if misses:
        print("misses (planted -> named first; position of the planted family):")
        for r in misses:
            print(
                f"  {r.case} ({r.model}, seed {r.seed}): {r.planted} -> {r.top_raw} {r.strength:.2f}; "
                f"planted at {r.planted_position or 'absent'}"
            )
    return {
        "cases": len(runs),
        "judged": len(judged),
        "top1": len(correct),
        "right_rank": right_rank,
        "proved": proved,
        "calibration": calibration,
        "strong_causes": len(every),
        "strong_causes_right": every_ok,
        "experiments": len(exps),
        "cleared": cleared,
        "moved": moved,
        "no_ops": len(no_ops),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--models", default="tiny_moe,qwen2_moe,olmoe", help="comma-separated capture models")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument(
        "--provenance",
        default=",".join(PROVENANCES),
        help="which cases: " + ", ".join(PROVENANCES),
    )
    ap.add_argument("--cases", default="", help="only these case names (comma-separated)")
    ap.add_argument("--no-experiments", action="store_true", help="do not replay the suggested experiments")
    ap.add_argument("--json", default="", metavar="PATH", help="write every case run and the totals here")
    ap.add_argument(
        "--keep", default="", metavar="DIR", help="capture under DIR and keep the snapshots (default: a temporary dir)"
    )
    ap.add_argument(
        "--reuse", action="store_true", help="diagnose the captures already kept under --keep DIR (capture the rest)"
    )
    args = ap.parse_args(argv)
    cases = matrix_cases(tuple(p for p in args.provenance.split(",") if p))
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    runs: list[CaseRun] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-diagnosis-") as tmp:
        if args.keep:
            tmp = args.keep
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for model in [m for m in args.models.split(",") if m]:
            for seed in [int(s) for s in args.seeds.split(",") if s]:
                for case in cases:
                    if case.model is not None and model != args.models.split(",")[0]:
                        continue  # a case of its own model runs once
                    reuse = args.reuse and bool(args.keep)
                    run = run_case(case, case.model or model, seed, Path(tmp), not args.no_experiments, reuse)
                    runs.append(run)
                    state = (
                        "error"
                        if run.error
                        else ("no spike" if not run.spiked else f"{'ok' if run.correct else 'MISS'} {run.top}")
                    )
                    print(
                        f"[{time.perf_counter() - started:7.0f} s] {case.name} {run.model} s{seed}: {state} "
                        f"({run.seconds:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    if args.json:  # after every case, so a run stopped part-way keeps what it measured
                        Path(args.json).write_text(json.dumps({"runs": [asdict(r) for r in runs]}, indent=1))
    totals = report(runs)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [asdict(r) for r in runs], "totals": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
