"""CLI verbs of the capture side: `capture` (reference trainer run with a spike) and `checkpoint-interval`."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from axrl_spike_replay.capture.reference.model_choice import CAPTURE_MODELS
from axrl_spike_replay.capture.reference.presets import FAULT_SPEC_DEPTH, PRESETS
from axrl_spike_replay.capture.reference.strategies import PARALLEL_STRATEGIES
from axrl_spike_replay.cli.output import add_json_flag, emit, progress, table
from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json


def register(sub: Any) -> None:
    """Add `capture` and `checkpoint-interval`."""
    p = sub.add_parser(
        "capture",
        help="train the reference MoE policy with GRPO and capture spike snapshots of an injected burst",
        description="Train a tiny MoE policy with GRPO on a toy task (bf16 rollouts, routing replay, one process "
        "per data-parallel rank over gloo), inject the preset's burst of bad data around iteration 20 and write "
        "<out>/<run>~<job>__actor/ with logs/train.log and checkpoints/spike_snapshots/iter_<N>/.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="root under which the output dir is created")
    p.add_argument("--job", default="demo-moe-grpo", metavar="NAME", help="job name (default: demo-moe-grpo)")
    p.add_argument("--run", default=None, metavar="NAME", help="run name, the output dir prefix (default: ref-s<seed>)")
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="data-parallel ranks (default: 1)")
    p.add_argument("--steps", type=int, default=32, metavar="N", help="training iterations (default: 32)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed (default: 0)")
    p.add_argument(
        "--preset",
        default="ratio_outliers",
        metavar="NAME",
        help=f"injected fault: {', '.join(PRESETS)} (default: ratio_outliers)",
    )
    p.add_argument(
        "--model",
        default="tiny_moe",
        choices=CAPTURE_MODELS,
        help="the policy trained: tiny_moe, or a transformers MoE architecture at a tiny size (hidden 64, 8 experts, "
        "top-2, vocab 1024, 32-token responses; model kind hf in run_config.yaml) (default: tiny_moe)",
    )
    p.add_argument(
        "--parallel",
        default="ddp",
        choices=PARALLEL_STRATEGIES,
        help="how the policy is spread over the ranks: ddp (replicated, all-reduced gradients) or fsdp (FSDP2 "
        "fully_shard; the snapshot's weights are a sharded DCP checkpoint, as FSDP trainers save) (default: ddp)",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="JSON",
        help="plant a built-in fault (capture.fault_injection.faults) during the burst, over the preset's, as JSON "
        '(e.g. \'{"kind": "logprob_shift", "ranks": [-1], "params": {"signal": "old_logprobs"}}\'); repeatable',
    )
    p.add_argument(
        "--hide-fault",
        action="store_true",
        help="keep the preset's name and its faults out of the snapshots and the log (train.preset: hidden), so "
        "a diagnosis of them cannot read the answer there",
    )
    add_json_flag(p)
    p.set_defaults(handler=_capture)

    p = sub.add_parser(
        "checkpoint-interval",
        help="Young-Daly checkpoint interval K* = sqrt(2 * cost * mtbf_steps / step_time) and overheads around it",
        description="The checkpoint interval (in steps) that minimises time lost to writing checkpoints plus "
        "redoing steps after a spike rollback, and the expected overhead of intervals around it.",
    )
    p.add_argument("--checkpoint-cost", type=float, required=True, metavar="SECONDS", help="seconds per checkpoint")
    p.add_argument("--mtbf-steps", type=float, required=True, metavar="N", help="mean steps between spikes")
    p.add_argument("--step-time", type=float, required=True, metavar="SECONDS", help="seconds per training step")
    add_json_flag(p)
    p.set_defaults(handler=_checkpoint_interval)


def _capture(args: argparse.Namespace) -> int:
    if args.world_size < 1 or args.world_size > 64:
        raise AxrlError(f"--world-size must be between 1 and 64, got {args.world_size}")
    if args.steps < 1:
        raise AxrlError(f"--steps must be >= 1, got {args.steps}")
    if args.seed < 0:
        raise AxrlError(f"--seed must be >= 0, got {args.seed}")
    from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
    from axrl_spike_replay.errors import ConfigError

    if args.preset not in PRESETS:
        raise AxrlError(f"--preset {args.preset!r} is not known (known: {', '.join(PRESETS)})")

    faults = _faults(args.fault)
    if faults and args.preset == "none":
        raise AxrlError("--fault acts during the burst, and preset none has none: use a base preset such as peaked")
    progress(
        f"capture: training {args.steps} steps on {args.world_size} rank(s) ({args.parallel}), preset {args.preset}, "
        f"model {args.model} ..."
    )
    try:
        result = capture_reference_run(
            args.out,
            job=args.job,
            world_size=args.world_size,
            steps=args.steps,
            seed=args.seed,
            preset=args.preset,
            run=args.run,
            parallel=args.parallel,
            model=args.model,
            progress=True,
            faults=faults,
            hide_fault=args.hide_fault,
        )
    except ConfigError as exc:
        text = str(exc)
        for name in ("out", "job", "run"):
            if text.startswith(f"{name} "):
                text = f"--{text}"
        raise AxrlError(text) from None
    emit(result.summary(), args.json, _render_capture)
    return 0


def _faults(items: list[str]) -> list[Any]:
    """The `--fault` items as built-in faults; AxrlError naming the bad item."""
    if not items:
        return []
    from axrl_spike_replay.capture.fault_injection.faults import make_fault
    from axrl_spike_replay.capture.reference.presets import FaultSpec
    from axrl_spike_replay.errors import ConfigError

    faults = []
    for n, item in enumerate(items, 1):
        try:
            doc = parse_untrusted_json(os.fsencode(item), FAULT_SPEC_DEPTH)
        except UntrustedInputError as exc:
            raise AxrlError(f"--fault {n} {exc}: {shown(item, 80)}") from None
        try:
            faults.append(make_fault(FaultSpec.from_dict(doc, f"--fault {n}")))
        except ConfigError as exc:
            raise AxrlError(str(exc) if str(exc).startswith("--fault") else f"--fault {n}: {exc}") from None
    return faults


def _render_capture(doc: dict[str, Any]) -> str:
    lines = [
        f"output dir: {doc['output_dir']}",
        f"log:        {doc['log_path']}",
        f"model {doc.get('model', 'tiny_moe')}, preset {doc['preset']}, "
        f"world size {doc['world_size']} ({doc.get('parallel', 'ddp')}), "
        f"{doc['steps']} steps, seed {doc['seed']}, "
        f"{doc['seconds']:.1f} s",
    ]
    if doc["spike_iterations"]:
        lines.append("spikes (snapshot written, step skipped):")
        rows = [
            [it, f"{doc['grad_norms'][it - 1]:.4g}", f"{ratio:.1f}x"]
            for it, ratio in zip(doc["spike_iterations"], doc["spike_ratios"], strict=True)
        ]
        lines.append(table(["iteration", "grad norm", "vs median"], rows))
    else:
        lines.append("no spike detected")
    lines.append("snapshots retained:")
    lines += [f"  {path}" for path in doc["snapshot_dirs"]] or ["  (none)"]
    return "\n".join(lines)


def _checkpoint_interval(args: argparse.Namespace) -> int:
    for flag, value in (
        ("--checkpoint-cost", args.checkpoint_cost),
        ("--mtbf-steps", args.mtbf_steps),
        ("--step-time", args.step_time),
    ):
        if not math.isfinite(value) or value <= 0:
            raise AxrlError(f"{flag} must be a finite number > 0, got {value}")
    from axrl_spike_replay.capture.checkpoint_interval import checkpoint_interval

    advice = checkpoint_interval(args.checkpoint_cost, args.mtbf_steps, args.step_time)
    emit(advice, args.json, _render_interval)
    return 0


def _render_interval(advice: Any) -> str:
    head = (
        f"optimal checkpoint interval: {_steps(advice.optimal_interval_steps)} steps "
        f"(K* = sqrt(2 x {advice.checkpoint_cost_s:g} s x {advice.mtbf_steps:g} steps / {advice.step_time_s:g} s) "
        f"= {_exact(advice.optimal_interval_exact)}), expected overhead {_percent(advice.optimal_overhead)}"
    )
    rows = [
        [
            _steps(o.interval_steps),
            _percent(o.checkpoint_overhead),
            _percent(o.expected_rework),
            _percent(o.total_overhead),
            "K*" if o.interval_steps == advice.optimal_interval_steps else "",
        ]
        for o in advice.options
    ]
    return head + "\n" + table(["interval (steps)", "checkpointing", "rework", "total", "optimal"], rows)


def _percent(fraction: float) -> str:
    """A percentage, in scientific notation when it would be long (absurd inputs give absurd overheads)."""
    return f"{fraction:.2%}" if abs(fraction) < 1e4 else f"{fraction * 100:.3g}%"


def _steps(interval: int) -> str:
    """A step count, in scientific notation when it would be long."""
    return str(interval) if interval < 10**12 else f"{float(interval):.3g}"


def _exact(interval: float) -> str:
    return f"{interval:.1f}" if interval < 1e12 else f"{interval:.3g}"
