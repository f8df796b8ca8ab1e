#!/usr/bin/env python3
"""Regenerate the repository's `spike-mitigation-methods/` from real replays of the reference trainer.

For each spike preset: capture a run, preserve its worst snapshot, open a task, replay the
baseline at full fidelity, sweep the seed workflow's methods and the classic loss-level guards,
attribute the spike to its samples (the method files quote it), and write up every config that
cleared (or partly cleared) the spike, refusing duplicates as the tool always does. The method
files, the index and each method's replay results (baseline and mitigated `replay_result.json`)
are then copied into the repository, and the main skill's list of recorded methods is refreshed.
Nothing here is written by hand.

    .venv/bin/python scripts/make_methods.py [--presets ratio_outliers negative_advantage_dominance stale_routes]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from axrl_spike_replay.experiment.mitigation.mitigation_sets import DEFAULT_SWEEP
from axrl_spike_replay.files.atomic import atomic_write_text
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.skill_pack import methods_block, with_methods_block
from axrl_spike_replay.snapshot.listing import list_snapshots
from axrl_spike_replay.snapshot.preservation.preserve import preserve
from axrl_spike_replay.workspace.method_files.methods import list_methods, write_index
from axrl_spike_replay.workspace.method_files.sweep_writeup import write_up_sweep
from axrl_spike_replay.workspace.report import write_report
from axrl_spike_replay.workspace.task_record.task_state import note, set_snapshot

REPO = Path(__file__).resolve().parent.parent
PLACEHOLDER = "<regeneration-workspace>"
PRESETS = ["ratio_outliers", "negative_advantage_dominance", "stale_routes"]
# The policy each preset trains: a routing fault needs real routers (a transformers architecture).
PRESET_MODELS = {"stale_routes": "qwen3_moe"}
# Configs swept beyond the default sweep: on stale_routes the spike goes through the k3 KL penalty (the wrong
# experts move log-probs by tens of nats), so dropping the penalty is the loss-level control.
EXTRA_CONFIGS: dict[str, list[dict]] = {"stale_routes": [{"kl_coef": 0.0}]}


def investigate(workspace: Path, preset: str, seed: int) -> list[dict]:
    """Capture, preserve, replay, sweep and write up one preset; return one summary row per config."""
    from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run

    job = f"ref-{preset.replace('_', '-')}"
    model = PRESET_MODELS.get(preset, "tiny_moe")
    capture = capture_reference_run(workspace / "outputs", job=job, world_size=2, seed=seed, preset=preset, model=model)
    if not capture.snapshot_dirs:
        print(f"[{preset}] no spike tripped the guard; nothing to write up", file=sys.stderr)
        return []
    listing = list_snapshots(capture.output_dir)
    worst = max(listing.snapshots, key=lambda s: s.spike_ratio or 0.0)
    snapshot = preserve(capture.output_dir, worst.iteration).preserved[0].path
    open_task(workspace, job, snapshot)
    set_snapshot(workspace, job, snapshot)
    baseline = run_request(replay_request(What(snapshot), workspace=workspace, job=job))
    print(
        f"[{preset}] baseline {baseline.grad_norm:.6g} vs recorded {baseline.recorded_grad_norm:.6g} "
        f"({baseline.fidelity}, rel_diff {baseline.rel_diff:.2g}) -> {baseline.verdict}",
        file=sys.stderr,
    )
    configs = [*DEFAULT_SWEEP, *EXTRA_CONFIGS.get(preset, [])]
    sweep = run_request(replay_request(What(snapshot, verb="sweep", configs=configs), workspace=workspace, job=job))
    # recorded in the job's runs: the method files quote its per-sample figures (`method add` replays nothing)
    run_request(replay_request(What(snapshot, verb="attribute", top=3), workspace=workspace, job=job))
    context = f"Preset {preset} ({model}): "
    writeups = write_up_sweep(workspace, job, sweep, verdicts=("cleared", "partial"), context=context)
    rows = [
        {
            "preset": preset,
            "model": model,
            "config": r.config_id,
            "baseline": r.baseline_grad_norm,
            "grad_norm": r.grad_norm,
            "ratio": r.spike_ratio,
            "verdict": r.verdict,
            "written": w.path or w.skipped,
        }
        for r, w in zip(sweep.results, writeups, strict=True)
    ]
    note(
        workspace,
        job,
        "observations",
        "cleared by: " + ", ".join(r["config"] for r in rows if r["verdict"] == "cleared"),
    )
    write_report(workspace, job, release=True)
    return rows


def clear_shipped() -> None:
    """Remove the repository's method files and evidence (README files stay): regenerated methods are compared
    with the shipped ones, and must not be taken for confirmations of their own previous versions."""
    target = REPO / "spike-mitigation-methods"
    for old in target.glob("*.md"):
        if old.name != "README.md":
            old.unlink()
    for old in (target / "evidence").glob("*/"):
        shutil.rmtree(old)


def export(workspace: Path) -> None:
    """Copy method files and their evidence into the repository, paths rewritten to a placeholder."""
    target = REPO / "spike-mitigation-methods"
    clear_shipped()
    for method in list_methods(workspace):
        slug = method.slug
        text = Path(method.path).read_text(encoding="utf-8").replace(str(workspace), PLACEHOLDER)
        (target / f"{slug}.md").write_text(text, encoding="utf-8")
        evidence = target / "evidence" / slug
        evidence.mkdir(parents=True)  # evidence/README.md stays
        mitigated = Path(method.front_matter["result_path"])
        shutil.copy2(mitigated, evidence / "replay_result.json")
        baseline = mitigated.parent.parent / "baseline" / "replay_result.json"
        if baseline.is_file():
            shutil.copy2(baseline, evidence / "baseline_replay_result.json")
        for file in evidence.iterdir():
            file.write_text(file.read_text(encoding="utf-8").replace(str(workspace), PLACEHOLDER), encoding="utf-8")
    write_index(REPO)
    skill = REPO / "skills" / "axrl-spike-replay" / "SKILL.md"  # its recorded-methods list follows the files
    atomic_write_text(skill, with_methods_block(skill.read_text(encoding="utf-8"), methods_block(list_methods(REPO))))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=PRESETS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the regeneration workspace")
    args = parser.parse_args()
    workspace = Path(tempfile.mkdtemp(prefix="axrl-methods-"))
    clear_shipped()  # tracked in git: an interrupted run is undone with `git checkout spike-mitigation-methods`
    rows = []
    for preset in args.presets:
        rows += investigate(workspace, preset, args.seed)
    export(workspace)
    print(json.dumps(rows, indent=2))
    if not args.keep:
        shutil.rmtree(workspace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
