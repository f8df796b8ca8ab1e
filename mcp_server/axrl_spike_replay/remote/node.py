"""The `node` verb: probe a GPU node (and optionally install this package there first)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from axrl_spike_replay.remote.nodes.install import install_package
from axrl_spike_replay.remote.nodes.node_probe import NodeReport, probe
from axrl_spike_replay.remote.nodes.remote_speeds import SpeedsRequest, measure_on_node
from axrl_spike_replay.remote.transport.connect import connect_settings
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.transport.session import open_session
from axrl_spike_replay.remote.transport.target import SshTarget
from axrl_spike_replay.remote.transport.target_config import ResolvedTarget
from axrl_spike_replay.remote.workspace_config import load_workspace_config, resolve_target


async def probe_node_async(
    target: str | SshTarget | ResolvedTarget,
    remote_python: str | None = None,
    snapshot: str | Path | None = None,
    *,
    install: bool = False,
    options: RemoteOptions | None = None,
    workspace: str | Path = ".",
    progress: Callable[[str], None] | None = None,
    speeds: SpeedsRequest | None = None,
) -> NodeReport:
    """Probe `target` over one SSH connection: GPUs, Python, torch, this package; a snapshot's replay plan; with
    `speeds`, the node's read and compute speeds measured there (`remote_speeds`, into `report.speeds`)."""
    options = options or RemoteOptions()
    resolved = _resolve(target, workspace, remote_python or options.remote_python)
    if snapshot is not None:  # bad input fails before connecting
        from axrl_spike_replay.remote.nodes.results import snapshot_facts

        snapshot_facts(snapshot)
    async with await open_session(
        resolved.ssh, connect_settings(options.known_hosts or resolved.known_hosts, options.accept_new_host_key)
    ) as session:
        session.label = resolved.label
        installed = None
        if install:
            installed = await install_package(session, resolved.python, setup=resolved.setup, progress=progress)
        report = await probe(session, python=resolved.python, setup=resolved.setup, snapshot=snapshot)
        if speeds is not None:
            if progress is not None:
                progress(f"measuring the read and compute speeds of {report.hostname or resolved.label}")
            report.speeds = await measure_on_node(session, report, resolved.python, resolved.setup, speeds)
        recorded = session.connection.client.check.recorded
    if installed is not None:
        report.notes.append(
            f"installed {installed.wheel} into {installed.python} (version {installed.installed_version})"
        )
    if recorded:
        report.notes.append(f"new host key recorded: {recorded}")
    return report


def probe_node(
    target: str | SshTarget | ResolvedTarget,
    remote_python: str | None = None,
    snapshot: str | Path | None = None,
    *,
    install: bool = False,
    options: RemoteOptions | None = None,
    workspace: str | Path = ".",
    progress: Callable[[str], None] | None = None,
    speeds: SpeedsRequest | None = None,
) -> NodeReport:
    """Synchronous `probe_node_async` (the CLI's `node` verb, `plan --target`)."""
    return asyncio.run(
        probe_node_async(
            target,
            remote_python,
            snapshot,
            install=install,
            options=options,
            workspace=workspace,
            progress=progress,
            speeds=speeds,
        )
    )


def _resolve(target: str | SshTarget | ResolvedTarget, workspace: str | Path, python: str | None) -> ResolvedTarget:
    if isinstance(target, ResolvedTarget):
        return ResolvedTarget(target.ssh, python or target.python, target.setup, target.known_hosts, target.name)
    if isinstance(target, SshTarget):
        return ResolvedTarget(ssh=target, python=python or "python3")
    return resolve_target(target, load_workspace_config(workspace), python)
