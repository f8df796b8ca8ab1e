"""`plan`: what a replay of a snapshot needs per process, and whether it fits where it would run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from axrl_spike_replay.cli.output import add_json_flag, emit, progress
from axrl_spike_replay.cli.remote_options import add_connection_options, remote_options_from_args
from axrl_spike_replay.cli.request_options import add_declared_option


def register(sub: Any) -> None:
    """Add `plan`."""
    p = sub.add_parser(
        "plan",
        help="say before anything loads what a replay needs per process and whether it fits (no weight read)",
        description="From the snapshot's metadata, run config and batch shapes (the model built on the meta device, "
        "no weight read): parameters, gradients and peak activation memory per process for N processes in the "
        "precision that runs; whether that fits this machine, a target's GPUs (node probe) or a node you describe; "
        "the smallest N for full fidelity and the layout it suggests.",
    )
    p.add_argument("snapshot", help="spike snapshot directory (iter_<N>); a config-only one is enough")
    p.add_argument("--target", default=None, help="an SSH target, or a multinode: or slurm: entry of spike-replay.yaml")
    for name in ("nproc", "device", "shard"):  # as a replay takes them
        add_declared_option(p, name)
    p.add_argument("--gpus", type=int, default=None, metavar="N", help="plan for a node of N GPUs (with --gpu-memory)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB", help="each GPU's memory, in GiB")
    p.add_argument("--workspace", default=".", help="workspace root holding spike-replay.yaml (default .)")
    add_connection_options(p)
    add_json_flag(p)
    p.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    from axrl_spike_replay.investigation.planning import plan_for

    plan = plan_for(
        Path(args.snapshot),
        target=args.target,
        nproc=args.nproc,
        device=args.device,
        shard=args.shard,
        gpus=args.gpus,
        gpu_memory_gib=args.gpu_memory,
        workspace=Path(args.workspace),
        options=remote_options_from_args(args),
        progress=progress,
    )
    emit(plan.to_json(), args.json, lambda doc: plan.text())
    return 0
