"""The reference trainer: GRPO on a tiny MoE policy with bf16 rollouts, R3 routing replay and a spike guard.

`capture_reference_run` trains for a few dozen steps (one process per data-parallel rank), injects
a preset's burst of bad data, and lets the spike guard write snapshots of the spike steps under
`<out>/<run>~<job>__actor/checkpoints/spike_snapshots/`, with Megatron-style logs in `logs/train.log`.
Gradients come from `training.rank_step`, so a replay of a snapshot recomputes them exactly.
"""

from __future__ import annotations

import copy
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from axrl_spike_replay.capture.detectors import make_detector
from axrl_spike_replay.capture.fault_injection.faults import Fault
from axrl_spike_replay.capture.reference.fsdp_trainer import make_rank_trainer
from axrl_spike_replay.capture.reference.run_config import build_run_config, parse_run_config
from axrl_spike_replay.capture.reference.strategies import PARALLEL_STRATEGIES, parallel_strategy
from axrl_spike_replay.capture.reference.trainer_ranks import launch
from axrl_spike_replay.capture.spike_guard import GuardDecision, SpikeGuard
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.processes.process_starts import preload_for
from axrl_spike_replay.processes.rank_processes import refuse_in_spawned_import
from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.metadata import ParallelLayout

HIDDEN_PRESET = "hidden"  # what a snapshot of a `hide_fault` run records as its preset
PROGRESS_LINES = 8  # about this many iteration lines per run, plus one per spike
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch: `$` lets "\n" through


@dataclass
class CaptureResult:
    """What a reference run produced."""

    output_dir: Path
    snapshot_dirs: list[Path]
    spike_iterations: list[int]
    spike_ratios: list[float]
    grad_norms: list[float | None]  # per step, global pre-clip (None for train.skip_iterations)
    log_path: Path
    config: dict[str, Any]
    job_name: str = ""
    seconds: float = 0.0
    final_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (no tensors)."""
        return {
            "output_dir": str(self.output_dir),
            "job_name": self.job_name,
            "preset": self.config["train"]["preset"],
            "model": self.config["model"].get("architecture", self.config["model"].get("kind", "tiny_moe")),
            "world_size": self.config["parallel"]["world_size"],
            "parallel": self.config["parallel"].get("strategy", "ddp"),
            "steps": self.config["train"]["steps"],
            "seed": self.config["train"]["seed"],
            "snapshot_dirs": [str(p) for p in self.snapshot_dirs],
            "spike_iterations": self.spike_iterations,
            "spike_ratios": self.spike_ratios,
            "grad_norms": self.grad_norms,
            "log_path": str(self.log_path),
            "seconds": round(self.seconds, 3),
        }


def capture_reference_run(
    out: str | Path,
    *,
    job: str = "demo-moe-grpo",
    world_size: int = 1,
    steps: int = 32,
    seed: int = 0,
    preset: str = "ratio_outliers",
    run: str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    legacy_layout: bool = False,
    keep_final_state: bool = False,
    parallel: str = "ddp",
    model: str = "tiny_moe",
    progress: bool = False,
    faults: Sequence[Fault] = (),
    hide_fault: bool = False,
) -> CaptureResult:
    """Train the reference policy and capture its spikes into `<out>/<run>~<job>__actor/`.

    `overrides` replaces run-config values per section (e.g. `{"train": {"guard_action": "log"}}`);
    `legacy_layout` writes old-style snapshots (AXRL keys in `metadata.json`); `keep_final_state`
    returns the final weights (rank 0) in the result. `parallel` is `ddp` (replicated weights, all-reduced
    gradients) or `fsdp` (FSDP2 `fully_shard`, weights saved as a sharded DCP checkpoint); it is recorded
    as `parallel.strategy` in the run config when it is not the default. `model` is `tiny_moe` or one of the
    transformers architectures of `model_choice.HF_CAPTURE_MODELS` at a tiny size (`model: {kind: hf, ...}`).
    `progress` streams a line to stderr as the rank processes start and every few iterations (rank 0, flushed).
    `faults` are trainer bugs of your own (`capture.fault_injection.faults.Fault`: picklable, called at their stage of
    every step, after the preset's); `hide_fault` keeps the preset's name and fault out of what the snapshots and the
    log say (`train.preset: hidden`, no `train.fault`), so a diagnosis judged on them cannot read the answer there.
    """
    refuse_in_spawned_import("the capture")  # before anything is written: a script without a main guard
    run = run or f"ref-s{seed}"
    for name, value in (("job", job), ("run", run)):
        if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or "__" in value:
            raise ConfigError(f"{name} {value!r} must be letters, digits, '.', '_' or '-' (no '__'), e.g. demo-job")
    if not isinstance(world_size, int) or not 1 <= world_size <= 64:
        raise ConfigError(f"world_size must be an integer in [1, 64], got {world_size!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be an integer >= 1, got {steps!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    if parallel not in PARALLEL_STRATEGIES:
        raise ConfigError(f"parallel must be one of {', '.join(PARALLEL_STRATEGIES)}, got {parallel!r}")
    if parallel == "fsdp" and any("gradients" in getattr(f, "stages", (f.stage,)) for f in faults):
        raise ConfigError(
            "a fault at the `gradients` stage scales a rank's own gradients, which FSDP never holds whole: "
            "capture it with parallel ddp"
        )
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"out {root}: exists and is not a directory")
    output_dir = root / f"{run}~{job}__actor"
    if output_dir.exists():
        raise ConfigError(f"{output_dir}: already exists; choose another out directory or run name")
    config = build_run_config(
        preset=preset, steps=steps, seed=seed, world_size=world_size, overrides=overrides, model=model
    )
    if parallel != "ddp":
        config["parallel"]["strategy"] = parallel
    if faults:  # the caller's own faults, on record beside the preset's (a built-in one by its spec)
        config["train"]["fault"]["planted"] = [_fault_record(f) for f in faults]
    # what this trainer computes and reduces in (DDP and FSDP2 alike: no mixed precision), so a replay runs the same
    dtype = str(config["model"].get("dtype", "float32"))
    config["precision"] = {"param_dtype": dtype, "reduce_dtype": dtype, "output_dtype": None}
    (output_dir / "logs").mkdir(parents=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="axrl-capture-") as tmp:
        plan = RankPlan(
            config=config,
            output_dir=str(output_dir),
            job_name=job,
            result_path=str(Path(tmp) / "result.json"),
            final_state_path=str(Path(tmp) / "final.pt") if keep_final_state else None,
            legacy_layout=legacy_layout,
            progress=progress,
            faults=tuple(faults),
            hide_fault=hide_fault,
        )
        if progress and world_size > 1:
            _progress(f"starting {world_size} rank processes (each imports torch and builds the policy first)")
        section = plan.config.get("model")
        preload_for(
            str(section.get("kind")) if isinstance(section, dict) else ""
        )  # a server not yet running imports them
        launch(train_rank, world_size, plan)
        doc = json.loads(Path(plan.result_path).read_text(encoding="utf-8"))
        if progress:
            _progress(
                f"done in {time.perf_counter() - started:.1f} s: {len(doc['snapshot_dirs'])} snapshot(s) retained"
            )
        final_state = None
        if plan.final_state_path:
            from axrl_spike_replay.snapshot.safe_load import load_pt

            final_state = load_pt(plan.final_state_path)
    return CaptureResult(
        output_dir=output_dir,
        snapshot_dirs=[Path(p) for p in doc["snapshot_dirs"]],
        spike_iterations=[int(i) for i in doc["spike_iterations"]],
        spike_ratios=[float(r) for r in doc["spike_ratios"]],
        grad_norms=doc["grad_norms"],
        log_path=output_dir / "logs" / "train.log",
        config=config,
        job_name=job,
        seconds=time.perf_counter() - started,
        final_state=final_state,
    )


@dataclass
class RankPlan:
    """What every rank process needs (pickled into spawned processes)."""

    config: dict[str, Any]
    output_dir: str
    job_name: str
    result_path: str
    final_state_path: str | None = None
    legacy_layout: bool = False
    progress: bool = False  # rank 0 streams progress lines to stderr
    faults: tuple[Fault, ...] = ()  # the caller's own trainer bugs (capture.fault_injection.faults), after the preset's
    hide_fault: bool = False  # snapshots and log do not name the preset or its fault

    def recorded_config(self) -> dict[str, Any]:
        """The run config the snapshots record: the run's, or with `hide_fault` without the preset and its fault."""
        if not self.hide_fault:
            return self.config
        doc = copy.deepcopy(self.config)
        doc["train"]["preset"] = HIDDEN_PRESET
        doc["train"]["fault"] = {}
        return doc


def train_rank(rank: int, world_size: int, plan: RankPlan) -> None:
    """The training loop of one rank (the launcher's per-rank function)."""
    spec = parse_run_config(plan.config)
    trainer = make_rank_trainer(spec, rank, world_size, parallel_strategy(plan.config))
    trainer.faults += list(plan.faults)
    t, det = spec.train, spec.detector
    out = Path(plan.output_dir)
    guard = SpikeGuard(
        out / SNAPSHOTS_DIR,
        action=t.guard_action,
        detector=make_detector(
            det.kind,
            window=det.window,
            threshold=det.threshold,
            warmup=det.warmup,
            warmup_ratio=det.warmup_ratio,
            max_norm=det.max_norm,
        ),
        keep_last=t.keep_last,
        job_name=plan.job_name,
        role="actor",
        parallel=ParallelLayout(**{k: v for k, v in plan.config["parallel"].items() if k != "strategy"}),
        run_config=plan.recorded_config(),
        legacy_layout=plan.legacy_layout,
    )
    if t.guard_action == "rollback":
        guard.checkpoint(0, trainer.model, trainer.optimizer)
    log = (out / "logs" / "train.log").open("a", encoding="utf-8") if rank == 0 else None
    grad_norms: list[float | None] = []
    trips: list[GuardDecision] = []
    skipped = 0
    global_batch = t.prompts_per_rank * t.group_size * world_size
    model = getattr(spec.model, "architecture", "tiny_moe")  # what this rank built, as `capture --model` names it
    preset = HIDDEN_PRESET if plan.hide_fault else t.preset
    _log(
        log,
        f"> reference trainer: job {plan.job_name}, model {model}, preset {preset}, world size {world_size}, "
        f"seed {t.seed}",
    )
    every = max(1, t.steps // PROGRESS_LINES)
    started = time.perf_counter()
    if plan.progress and rank == 0:
        _progress(f"training {t.steps} iterations of {model}, preset {preset}, world size {world_size}")
    try:
        for iteration in range(1, t.steps + 1):
            start = time.perf_counter()
            if iteration in t.skip_iterations:
                grad_norms.append(None)
                skipped += 1
                _log(log, f" iteration {iteration:8d}/{t.steps:8d} | batch not used (train.skip_iterations) |")
                continue
            step = trainer.rollout(iteration)
            grads = trainer.gradients(step)
            grad_norms.append(grads.grad_norm)
            decision = guard.observe(iteration, grads.grad_norm)
            where = ""
            if decision.tripped:
                trips.append(decision)
                payload = {rank: trainer.snapshot_payload(step, grads)}
                path = guard.snapshot(decision, trainer.model_state(), payload)
                where = str(path.relative_to(out)) if path is not None else "not written (see the error logged)"
            if guard.apply(decision, trainer.model, trainer.optimizer):
                trainer.update(grads, step)
            else:
                skipped += 1
            if t.guard_action == "rollback" and iteration % t.checkpoint_interval == 0 and decision.apply_update:
                guard.checkpoint(iteration, trainer.model, trainer.optimizer)
            elapsed_ms = (time.perf_counter() - start) * 1000
            _log(
                log,
                f" iteration {iteration:8d}/{t.steps:8d} | consumed samples: {iteration * global_batch:12d} | "
                f"elapsed time per iteration (ms): {elapsed_ms:.1f} | learning rate: {t.lr:.6E} | "
                f"global batch size: {global_batch:5d} | lm loss: {grads.global_loss:.6E} | "
                f"grad norm: {grads.grad_norm:.6f} | reward: {step.global_reward_mean:.4f} | "
                f"number of skipped iterations: {skipped:3d} | number of nan iterations: "
                f"{int(not math.isfinite(grads.grad_norm)):3d} |",
            )
            if plan.progress and rank == 0 and (iteration % every == 0 or iteration == t.steps or decision.tripped):
                spike = f", spike ({decision.spike_ratio:.1f}x the median), snapshot {where}" if where else ""
                _progress(
                    f"iteration {iteration}/{t.steps}: grad norm {grads.grad_norm:.4g}{spike} "
                    f"({time.perf_counter() - started:.1f} s)"
                )
            if decision.tripped:
                early = decision.rule == "warmup_ratio"
                bar = f"warm-up ratio {det.warmup_ratio}" if early else f"threshold {det.threshold}"
                median = "the median of the steps seen so far" if decision.warming_up else "the rolling median"
                _log(
                    log,
                    f"[spike guard] iteration {iteration}: grad norm {decision.grad_norm:.6f} is "
                    f"{decision.spike_ratio:.2f}x {median} {decision.median_norm:.6f} "
                    f"({bar}); snapshot {where}; action: {decision.action}",
                )
    finally:
        if log is not None:
            log.close()
    final_state = trainer.final_state() if plan.final_state_path else None  # collective under FSDP
    if rank == 0:
        atomic_write_json(
            plan.result_path,
            {
                "grad_norms": grad_norms,
                "spike_iterations": [d.step for d in trips],
                "spike_ratios": [d.spike_ratio for d in trips],
                "snapshot_dirs": [str(p) for p in guard.snapshots if p.exists()],
            },
        )
        if plan.final_state_path:
            torch.save(final_state, plan.final_state_path)


def _fault_record(fault: Fault) -> dict[str, Any]:
    """How the run config records a fault of the caller's: a built-in one's spec, else its type, stage and part."""
    spec = getattr(fault, "spec", None)
    if spec is not None and hasattr(spec, "to_dict"):
        return spec.to_dict()
    return {"type": type(fault).__qualname__, "stage": fault.stage, "part": fault.part}


def _progress(line: str) -> None:
    """A progress line on stderr, flushed at once (stdout stays for the caller's output)."""
    print(f"capture: {line}", file=sys.stderr, flush=True)


def _log(handle: TextIO | None, line: str) -> None:
    if handle is not None:
        handle.write(line + "\n")
        handle.flush()
