"""The demo: the whole procedure on a spike captured right now by the reference trainer.

capture → resolve → open the task → list → preserve → diagnose into the task → inspect → analyze → scan logs →
replay the baseline → sweep mitigations → attribute → diagnose again with the model evidence → write up what proved
out → report → release. Every figure shown comes from the step that computed it.

The demo knows the fault it planted (its preset's), and the snapshots and the log do not name it (the capture hides
it), so the diagnosis cannot read the answer there: the report's Observations then say what was planted and whether
the diagnosis named it, for a user to check the tool against.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.percent import pct, pct_plain
from axrl_spike_replay.vocabulary import Fidelity, Verb, Verdict

if TYPE_CHECKING:
    from axrl_spike_replay.experiment.result import Attribution, ReplayResult, SweepResult
    from axrl_spike_replay.investigation.request import What
    from axrl_spike_replay.snapshot.listing import SnapshotEntry

DEMO_JOB = "demo-moe-grpo"
_R = TypeVar("_R")


@dataclass
class DemoStep:
    """One step of the demo as a person reads it: a title and a few lines."""

    title: str
    lines: list[str] = field(default_factory=list)


@dataclass
class DemoSummary:
    model: str  # the policy the reference run trained: tiny_moe or a transformers architecture
    workspace: str
    output_dir: str
    snapshot: str
    preserved: str
    fidelity: Fidelity
    baseline_grad_norm: float | None
    recorded_grad_norm: float | None
    rel_diff: float | None
    baseline_verdict: Verdict
    cleared: list[str]
    methods: list[str]
    report: str
    task_file: str
    steps: list[DemoStep]
    seconds: float
    causes: list[str] = field(default_factory=list)  # diagnose's likely causes, strongest first
    planted: str | None = None  # the cause family the demo's preset planted (None: a preset without one)
    diagnosed: str | None = None  # the family the diagnosis with the model evidence ranked first


def _fmt(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


@dataclass
class _Run:
    """The demo under way: its folder, the steps shown so far and the caller's callbacks."""

    root: Path
    show: Callable[[DemoStep], None] | None
    progress: Callable[[str], None] | None
    done: list[DemoStep] = field(default_factory=list)

    def starting(self, what: str) -> None:
        """Say that a step starts (to `progress`)."""
        if self.progress:
            self.progress(f"demo: {what} ...")

    def step(self, title: str, lines: list[str]) -> None:
        """Keep a finished step and show it."""
        item = DemoStep(title, lines)
        self.done.append(item)
        if self.show:
            self.show(item)


@dataclass
class _Found:
    """What step 2 found and kept: the job's role, its worst snapshot and the preserved copy."""

    output_dir: str
    worst: SnapshotEntry  # the worst iteration's
    snapshot: str  # the preserved copy, which the rest of the demo reads
    task_file: str


@dataclass
class _Reproduced:
    """What step 4 computed: the baseline replay, the sweep and what the diagnosis with the model evidence found."""

    baseline: ReplayResult
    sweep: SweepResult
    planted: str | None
    diagnosed: str | None


def run_demo(
    workspace: str | Path,
    *,
    preset: str = "ratio_outliers",
    world_size: int = 2,
    seed: int = 0,
    steps: int = 32,
    show: Callable[[DemoStep], None] | None = None,
    model: str = "tiny_moe",
    progress: Callable[[str], None] | None = None,
) -> DemoSummary:
    """Run the demo in a fresh timestamped folder under `workspace`; `show` receives each step as it ends.
    `model`: the policy the reference run trains (`tiny_moe`, or a transformers architecture at a tiny size).
    `progress` receives a line as each step starts and the replays' own progress lines as they run; the capture's
    rank processes then stream theirs to stderr."""
    from axrl_spike_replay.workspace.task_record.task_state import show_task

    started = time.perf_counter()
    root = Path(workspace).resolve() / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=False)
    run = _Run(root, show, progress)
    _capture_spike(run, preset=preset, world_size=world_size, seed=seed, steps=steps, model=model)
    found = _find_and_preserve(run)
    causes = _read_snapshot(run, found)
    done = _reproduce_and_mitigate(run, found.snapshot, preset)
    cleared, methods, report = _write_up(run, done.sweep)
    return DemoSummary(
        model=model,
        workspace=str(root),
        output_dir=found.output_dir,
        snapshot=str(found.worst.path),
        preserved=found.snapshot,
        fidelity=done.baseline.fidelity,
        baseline_grad_norm=done.baseline.grad_norm,
        recorded_grad_norm=done.baseline.recorded_grad_norm,
        rel_diff=done.baseline.rel_diff,
        baseline_verdict=done.baseline.verdict,
        cleared=cleared,
        methods=methods,
        report=report,
        task_file=show_task(root, DEMO_JOB).task_file,
        steps=run.done,
        seconds=time.perf_counter() - started,
        causes=causes,
        planted=done.planted,
        diagnosed=done.diagnosed,
    )


def _capture_spike(run: _Run, *, preset: str, world_size: int, seed: int, steps: int, model: str) -> None:
    """Step 1: a reference training run that hits a spike (the fault hidden from its snapshots and log)."""
    from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run

    run.starting(f"capture: a reference GRPO run of {model}, {steps} steps on {world_size} rank(s), preset {preset}")
    capture = capture_reference_run(
        run.root / "outputs",
        job=DEMO_JOB,
        world_size=world_size,
        seed=seed,
        steps=steps,
        preset=preset,
        model=model,
        progress=run.progress is not None,
        hide_fault=True,  # the snapshots and the log do not name the fault: the diagnosis must find it
    )
    if not capture.snapshot_dirs:
        raise AxrlError(
            f"the reference run of {model} (preset {preset!r}, {steps} steps) tripped no spike guard; "
            "nothing to investigate"
        )
    run.step(
        "capture",
        [
            f"reference GRPO run of {model}, preset {preset}, world size {world_size}, {steps} steps "
            f"in {capture.seconds:.1f} s",
            f"spike guard tripped at iterations {capture.spike_iterations} "
            f"(ratios {', '.join(f'{r:.1f}' for r in capture.spike_ratios)})",
            f"output dir {capture.output_dir}",
        ],
    )


def _find_and_preserve(run: _Run) -> _Found:
    """Step 2: find the job, open the task, list its snapshots and preserve the worst (which diagnoses it)."""
    from axrl_spike_replay.investigation.task_opening import open_task
    from axrl_spike_replay.snapshot.discovery import resolve_job
    from axrl_spike_replay.snapshot.listing import list_snapshots
    from axrl_spike_replay.snapshot.preservation.preserve import preserve

    run.starting("resolve the job, list and preserve its snapshots, open the task")
    resolution = resolve_job(DEMO_JOB, [run.root / "outputs"])
    role = resolution.roles[0]
    open_task(run.root, DEMO_JOB)
    listing = list_snapshots(role.output_dir)
    worst = max(listing.snapshots, key=lambda s: s.spike_ratio or 0.0)
    kept = preserve(role.output_dir, worst.iteration)
    if not kept.preserved:
        raise AxrlError(f"preserving iteration {worst.iteration} failed: {kept.failed}")
    snapshot = kept.preserved[0].path
    opened = open_task(run.root, DEMO_JOB, snapshot)  # sets the snapshot and diagnoses it (static evidence)
    run.step(
        "resolve, list, preserve",
        [f"role {r.role}: {r.output_dir} ({len(r.logs)} log file(s))" for r in resolution.roles]
        + [
            f"iter {s.iteration}: {s.bytes / 1e6:.2f} MB, spike ratio {_fmt(s.spike_ratio)}"
            + (" (preserved)" if s.preserved else "")
            for s in listing.snapshots
        ]
        + [
            f"preserved iter {worst.iteration} as hardlinks: {kept.preserved[0].linked_files} files linked, "
            f"{kept.preserved[0].copied_files} copied -> {snapshot}"
        ],
    )
    return _Found(role.output_dir, worst, snapshot, opened.task_file)


def _read_snapshot(run: _Run, found: _Found) -> list[str]:
    """Step 3: inspect and analyze the preserved snapshot, show the task's diagnosis and scan the logs; the likely
    causes' titles."""
    from axrl_spike_replay.analysis.batch_signals import analyze_snapshot
    from axrl_spike_replay.diagnosis.evidence.log_scan import scan_logs
    from axrl_spike_replay.snapshot.inspect import inspect_snapshot
    from axrl_spike_replay.workspace.report import task_diagnosis

    run.starting("inspect, analyze and diagnose the worst snapshot")
    info = inspect_snapshot(found.snapshot)
    analysis = analyze_snapshot(found.snapshot, top=3)
    balance = analysis.sign_balance or {}
    outliers = analysis.outliers.get("tokens_by_abs_log_ratio_old_vs_rollout", [])[:3]
    run.step(
        "inspect, analyze",
        [
            f"iteration {info.iteration}: grad norm {_fmt(info.grad_norm)} vs median {_fmt(info.median_norm)} "
            f"= ratio {_fmt(info.spike_ratio)}; world size {info.world_size} "
            f"(tp {info.tp}, pp {info.pp}, dp {info.dp}, ep {info.ep})",
            f"model: {info.model.tensors if info.model else '?'} tensors, "
            f"{(info.model.bytes if info.model else 0) / 1e6:.2f} MB; problems: {info.problems or 'none'}",
            *(
                f"rank {r.rank}: {r.num_samples} samples, {r.num_loss_tokens} loss tokens, "
                f"routed tokens per MoE layer {r.routing_payload_counts}"
                for r in info.ranks
            ),
            f"advantage sign balance: negative {_fmt(balance.get('negative_total'))} vs positive "
            f"{_fmt(balance.get('positive_total'))} (ratio {_fmt(balance.get('negative_to_positive'))})",
            *(
                f"outlier token: rank {o['rank']} sample {o['sample']} pos {o['position']} token {o['token_id']}: "
                f"log(pi_old/pi_rollout) {_fmt(o.get('log_ratio_old_vs_rollout'))} "
                f"(old {_fmt(o.get('old_logprob'))}, rollout "
                f"{_fmt(o.get('rollout_logprob'))}), advantage {_fmt(o.get('advantage'))}"
                for o in outliers
            ),
        ],
    )
    diagnosis = task_diagnosis(run.root, DEMO_JOB) or {}
    run.step(
        "diagnose",
        [
            f"likely cause: {c['title']} (strength {c['strength']:.2f}): {'; '.join(c['evidence'])}"
            for c in diagnosis.get("likely", [])
        ]
        + [f"next step: --mitigation {s['mitigation']}" for s in diagnosis.get("next_steps", [])]
        + [f"written into the task's Observations and Next steps: {found.task_file}"],
    )
    scan = scan_logs([found.output_dir], run.root / "tmp" / "spike-replay" / DEMO_JOB / "logs")
    run.step(
        "logs",
        [
            f"{len(scan.series_points)} iterations logged; spikes by the detector: "
            + ", ".join(f"iter {s['iteration']} (ratio {s['spike_ratio']:.1f})" for s in scan.spikes),
            f"{len(scan.errors)} error line(s)",
        ],
    )
    return [c["title"] for c in diagnosis.get("likely", [])]


def _reproduce_and_mitigate(run: _Run, snapshot: str, preset: str) -> _Reproduced:
    """Step 4: replay the baseline, sweep the default mitigations, attribute the norm to samples, and diagnose again
    with the model evidence, saying whether the planted fault was named."""
    from axrl_spike_replay.experiment.mitigation.mitigation_sets import DEFAULT_SWEEP
    from axrl_spike_replay.experiment.result import Attribution, ReplayResult, SweepResult
    from axrl_spike_replay.investigation.request import What
    from axrl_spike_replay.workspace.task_record.task_state import set_command

    set_command(run.root, DEMO_JOB, f"axrl-spike-replay replay {snapshot} --workspace {run.root}")
    run.starting("replay the spike step (baseline)")
    baseline = _request(run, What(Path(snapshot)), ReplayResult)
    run.step(
        "replay (baseline)",
        [
            f"fidelity {baseline.fidelity} ({baseline.world_size_used}/{baseline.world_size_saved} processes): "
            f"grad norm {_fmt(baseline.grad_norm, 8)} vs recorded {_fmt(baseline.recorded_grad_norm, 8)}, "
            f"rel_diff {_fmt(baseline.rel_diff, 3)} -> {baseline.verdict}",
        ],
    )
    run.starting(f"sweep {len(DEFAULT_SWEEP)} mitigation configs")
    sweep = _request(run, What(Path(snapshot), verb=Verb.SWEEP, configs=tuple(DEFAULT_SWEEP)), SweepResult)
    rows = [
        f"{r.config_id:<48} grad norm {_fmt(r.grad_norm):>10}  ratio {_fmt(r.spike_ratio):>8}  "
        f"change {pct(r.change_vs_baseline):>7}  {r.verdict}"
        for r in sweep.results
    ]
    run.step(f"sweep ({len(sweep.results)} configs, fidelity {sweep.fidelity}, threshold {sweep.threshold:g})", rows)

    # into the job's runs (attribution.json), where `method add` finds the per-sample figures it quotes
    run.starting("attribute the grad norm to samples")
    attribution = _request(run, What(Path(snapshot), verb=Verb.ATTRIBUTE, top=5), Attribution)
    run.step(
        "attribution",
        [f"grad norm {_fmt(attribution.grad_norm)}; contributions sum within {attribution.sum_rel_error:.1e}"]
        + [
            f"rank {s.rank} sample {s.sample}: contribution {_fmt(s.contribution)} ({pct_plain(s.share)}), "
            f"advantage {_fmt(s.advantage)}, max |log(pi/pi_{attribution.log_ratio_base})| "
            f"{_fmt(s.max_abs_log_ratio_current_vs_base)}"
            for s in attribution.samples
        ],
    )
    planted, diagnosed = _diagnose_with_model(run, snapshot, attribution, preset)
    return _Reproduced(baseline, sweep, planted, diagnosed)


def _request(run: _Run, what: What, kind: type[_R]) -> _R:
    """Run one replay request of the demo's job in its workspace; its result, of the kind the verb returns."""
    from axrl_spike_replay.investigation.request import replay_request
    from axrl_spike_replay.investigation.runs import run_request

    result = run_request(replay_request(what, workspace=run.root, job=DEMO_JOB, progress=run.progress))
    assert isinstance(result, kind)
    return result


def _diagnose_with_model(
    run: _Run, snapshot: str, attribution: Attribution, preset: str
) -> tuple[str | None, str | None]:
    """The step's own evidence settles what the static diagnosis left open (old or rollout log-probs off?): the
    report shows the strongest diagnosis, and the demo notes what it planted so the answer can be checked.
    (planted family, family ranked first)."""
    from axrl_spike_replay.capture.reference.presets import get_preset
    from axrl_spike_replay.diagnosis.rules.causes import LIKELY
    from axrl_spike_replay.investigation.task_opening import diagnose_into_task
    from axrl_spike_replay.workspace.task_record.task_state import note

    run.starting("diagnose again, with the model evidence (reusing the attribution)")
    strong = diagnose_into_task(run.root, snapshot, attribution=attribution, model="auto")
    planted = get_preset(preset)
    diagnosed = strong.top.family if strong.causes else None
    verdict = (
        "the diagnosis names it first"
        if diagnosed == planted.family
        else f"the diagnosis ranks {diagnosed or 'nothing'} first, NOT the planted family"
    )
    check = (
        f"**Planted by the demo:** preset `{preset}`, cause family `{planted.family}`: {planted.description}. The "
        f"snapshots and the log do not name it, so the diagnosis could not read it there; {verdict} "
        f"({strong.top.title}, strength {strong.top.strength:.2f}, with the model evidence)."
        if planted.family
        else f"**Planted by the demo:** preset `{preset}`, no cause family: {planted.description}."
    )
    note(run.root, DEMO_JOB, "observations", check)
    run.step(
        "diagnose (with the model evidence)",
        [
            f"likely cause: {c.title} [{c.family}] (strength {c.strength:.2f})"
            for c in strong.causes
            if c.family == "natural_spike" or c.strength >= LIKELY
        ]
        + [f"planted: {planted.family or 'no cause family'} (preset {preset}): {verdict}"],
    )
    return planted.family, diagnosed


def _write_up(run: _Run, sweep: SweepResult) -> tuple[list[str], list[str], str]:
    """Step 5: write up the methods that cleared the spike, write the report and release the preserved copy;
    (cleared configs, method files, report path)."""
    from axrl_spike_replay.workspace.method_files.sweep_writeup import write_up_sweep
    from axrl_spike_replay.workspace.report import write_report
    from axrl_spike_replay.workspace.task_record.task_state import note, show_task

    run.starting("write up the methods that cleared it, report, release the preserved copy")
    writeups = write_up_sweep(run.root, DEMO_JOB, sweep)
    methods = [w.path for w in writeups if w.path]
    for w in writeups:
        if w.verdict == Verdict.CLEARED and not w.path:
            note(run.root, DEMO_JOB, "observations", f"method {w.name} not added: {w.skipped}")
    cleared = [r.config_id for r in sweep.results if r.verdict == Verdict.CLEARED]
    note(run.root, DEMO_JOB, "observations", f"cleared by: {', '.join(cleared) or 'nothing'}")
    report = write_report(run.root, DEMO_JOB, release=True)
    run.step(
        "write-up",
        [f"method file: {m}" for m in methods]
        + [f"report: {report.path}", f"task file: {show_task(run.root, DEMO_JOB).task_file}"]
        + [
            f"released preserved copy: {r['path']}" if r.get("released") else f"kept {r['path']}: {r.get('error')}"
            for r in report.released
        ],
    )
    return cleared, methods, report.path
