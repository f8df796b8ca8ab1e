"""CLI face of the demo."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from axrl_spike_replay.capture.reference.model_choice import CAPTURE_MODELS
from axrl_spike_replay.capture.reference.presets import PRESETS
from axrl_spike_replay.cli.output import add_json_flag, emit, progress
from axrl_spike_replay.errors import AxrlError


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "demo",
        help="capture a spike with the reference trainer, then run the whole procedure on it",
        description="Capture a spike with the reference trainer and investigate it end to end in a demo workspace.",
    )
    parser.add_argument(
        "--workspace", default="demo-workspace", metavar="DIR", help="folder for the demo (default: %(default)s)"
    )
    parser.add_argument(
        "--preset",
        default="ratio_outliers",
        choices=PRESETS,
        help="the fault the reference run injects at iterations 20-22: %(choices)s (default: %(default)s)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        metavar="N",
        help="data-parallel ranks of the reference run, one process each (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        default="tiny_moe",
        choices=CAPTURE_MODELS,
        help="the policy of the reference run: tiny_moe or a tiny transformers MoE architecture (default: tiny_moe)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=32,
        metavar="N",
        help="training iterations of the reference run (default: 32; the presets' burst is at iterations 20-22)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the reference run: the same seed captures the same spike (default: %(default)s)",
    )
    add_json_flag(parser)
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise AxrlError(f"--steps must be >= 1, got {args.steps}")
    from axrl_spike_replay.demo import DemoStep, run_demo

    def show(step: DemoStep) -> None:
        out = sys.stderr if args.json else sys.stdout
        print(f"\n== {step.title}", file=out)
        for line in step.lines:
            print(f"   {line}", file=out)
        out.flush()

    summary = run_demo(
        args.workspace,
        preset=args.preset,
        world_size=args.world_size,
        seed=args.seed,
        steps=args.steps,
        show=show,
        model=args.model,
        progress=progress,
    )
    emit(summary, args.json, lambda s: f"\ndemo finished in {s.seconds:.1f} s; read {s.task_file} and {s.report}")
    return 0
