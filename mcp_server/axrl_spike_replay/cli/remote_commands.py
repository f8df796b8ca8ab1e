"""`node`: what a GPU node offers (GPUs, Python, torch, this package), and installing this package there."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from axrl_spike_replay.cli.output import add_json_flag, emit, progress
from axrl_spike_replay.cli.remote_options import add_connection_options, remote_options_from_args


def register(sub: Any) -> None:
    """Add `node`."""
    p = sub.add_parser(
        "node",
        help="probe a GPU node over SSH: GPUs, driver, Python, torch, this package; replay plan for a snapshot",
        description="Connect to TARGET (host keys verified) and report its GPUs (nvidia-smi), Python and torch "
        "versions and whether axrl_spike_replay is importable there. With --snapshot, say whether a replay fits at "
        "full fidelity (a GPU per saved rank) or will be reduced. With --install, first build this package as a "
        "wheel, copy it over SFTP and pip install it (--no-deps, no index) into the node's interpreter.",
    )
    p.add_argument(
        "target",
        help="a target name from spike-replay.yaml, or an ssh target: 'ssh -p 2222 root@10.0.0.5', user@host:port, "
        "ssh://user@host:port or a ~/.ssh/config Host",
    )
    p.add_argument("--snapshot", default=None, help="snapshot dir (same path on shared storage) to plan a replay for")
    p.add_argument("--install", action="store_true", help="install this package into the node's interpreter first")
    p.add_argument("--workspace", default=".", help="workspace root holding spike-replay.yaml (default .)")
    add_connection_options(p)
    add_json_flag(p)
    p.set_defaults(handler=_node)


def _node(args: argparse.Namespace) -> int:
    from axrl_spike_replay.remote.node import probe_node

    report = probe_node(
        args.target,
        args.remote_python,
        args.snapshot,
        install=args.install,
        options=remote_options_from_args(args),
        workspace=Path(args.workspace),
        progress=progress,
    )
    emit(report.to_json(), args.json, render_node)
    return 0


def render_node(doc: dict[str, Any]) -> str:
    """A node report for people."""
    gpus = doc["gpus"]
    if gpus:
        names = sorted({f"{g['name']} ({g['memory_total_mib']} MiB)" for g in gpus})
        gpu_line = f"{doc['gpu_count']} x {', '.join(names)}, driver {doc['driver']}"
    else:
        gpu_line = "none" + (" (nvidia-smi not found)" if doc["nvidia_smi"] == "not found" else "")
    torch = doc["torch_version"] or "not importable"
    if doc["torch_version"]:
        torch += f" (CUDA {doc['torch_cuda'] or 'none'}, {'available' if doc['cuda_available'] else 'not available'})"
    package = doc["package_version"] if doc["package_importable"] else "not importable (use --install)"
    lines = [
        f"node {doc['target']}" + (f" ({doc['hostname']})" if doc["hostname"] else ""),
        f"  GPUs               {gpu_line}",
        f"  python             {doc['python']} {doc['python_version'] or '(did not run)'}",
        f"  torch              {torch}",
        f"  axrl_spike_replay  {package}",
    ]
    if doc["snapshot"]:
        lines.append(f"  snapshot           {doc['snapshot']} (saved world size {doc['world_size_saved']})")
        lines.append(f"  replay plan        {doc['plan']}")
    lines += [f"  note               {note}" for note in doc["notes"]]
    return "\n".join(lines)
