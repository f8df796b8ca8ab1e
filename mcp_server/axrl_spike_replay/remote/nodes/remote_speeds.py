"""An SSH node's read and compute speeds for the plan's streamed row, measured on the node over the connection its
probe opened: the node runs `replay.plans.node_speeds_main` (this package, installed there), the same measurement a
plan here runs, with the entries kept for it here.

The read is of the snapshot's copy where the node holds one (the same path there), else of a temporary file written
in a directory made for the purpose under the node's `$TMPDIR` (where a replay there keeps its workspace); the
shell that made the directory removes it when the measurement ends, however it ends (`timeout` bounds it). What was
measured is kept here per node, keyed by its host identity (its host name and its SSH host key's fingerprint, not
this machine's name), in the workspace's `tmp/spike-replay/node-speeds-remote.json`; a later plan sends the node its
entries and the node measures only what is missing, stale or unreadable among them. A measurement that fails
(timeout, no space, no permission, the package not installed) leaves the assumed speeds with the reason: it never
fails the plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.remote.nodes.node_probe import NodeReport
from axrl_spike_replay.remote.transport.host_keys import fingerprint
from axrl_spike_replay.remote.transport.session import RemoteSession
from axrl_spike_replay.remote.transport.shell import bash_command, job_script
from axrl_spike_replay.replay.plans.node_speeds import MAX_CACHE_BYTES, read_kept, speeds_document
from axrl_spike_replay.replay.streamed.speeds import Speeds

MEASURE_TIMEOUT_S = 180.0  # the node's whole measurement: python and torch starting, the read, the matmul
_MARK = "@@axrl-speeds"
_MAIN = "axrl_spike_replay.replay.plans.node_speeds_main"
_MAX_SENT_CHARS = 64 << 10  # the kept entries sent to the node on its command line


@dataclass(frozen=True)
class SpeedsRequest:
    """What a node's speeds are measured for: the snapshot's weights dir (the same path on the node), the replay's
    device and dtype there; `cache`, the file here keeping every node's speeds (None: nothing kept)."""

    weights: str | None
    device: str
    dtype: str
    cache: Path | None = None
    timeout_s: float = MEASURE_TIMEOUT_S


def host_identity(session: RemoteSession, report: NodeReport) -> str:
    """The node as its speeds are kept: its host name and the fingerprint of the host key it presented."""
    key = session.connection.conn.get_server_host_key()
    return f"{report.hostname or session.label} {fingerprint(key) if key is not None else 'no host key'}"


def measure_script(python: str, setup: Sequence[str], request: dict[str, Any], timeout_s: float) -> str:
    """The node's shell script: the setup lines, a temporary directory under `$TMPDIR`, the measurement (bounded by
    `timeout` where the node has it), the directory removed, the exit status said."""
    command = shlex.join([python, "-m", _MAIN])
    lines = [
        'if _d=$(mktemp -d "${TMPDIR:-/tmp}/axrl-speeds-XXXXXXXX" 2>&1); then _e=""; else _e=$_d; _d=""; fi',
        f'_t=""; if command -v timeout >/dev/null 2>&1; then _t="timeout -k 5 {timeout_s:g}"; fi',
        f'$_t {command} "$_d" "$_e" {shlex.quote(json.dumps(request))} 2>&1',
        "_rc=$?",
        '[ -z "$_d" ] || rm -rf -- "$_d"',
        f'echo "{_MARK} rc $_rc"',
    ]
    return job_script("\n".join(lines), setup=setup)


async def measure_on_node(
    session: RemoteSession, report: NodeReport, python: str, setup: Sequence[str], ask: SpeedsRequest
) -> Speeds:
    """The node's speeds for `ask` (see the module docstring), said as measured on it; the assumed ones, with the
    reason, where they cannot be measured."""
    where = report.hostname or session.label
    if not report.package_importable:
        why = f"axrl_spike_replay is not importable with {python} there; `node TARGET --install` puts it there"
        return Speeds.assumed(ask.device, f"not measured on {where}: {why}")
    identity = host_identity(session, report)
    hosts = _load_hosts(ask.cache)
    kept = speeds_document(hosts.get(identity))
    if len(json.dumps(kept)) > _MAX_SENT_CHARS:
        kept = speeds_document(None)
    request = {"weights": ask.weights, "device": ask.device, "dtype": ask.dtype, "kept": kept}
    script = bash_command(measure_script(python, setup, request, ask.timeout_s))
    try:
        got = await session.capture(script, timeout=ask.timeout_s + 30.0)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the connection lost, the node's shell hung: the plan goes on at assumed speeds
        return Speeds.assumed(ask.device, f"not measured on {where}: {exc}")
    doc, reason = _result(got.stdout + got.stderr, got.exit_status, ask.timeout_s)
    speeds = None if doc is None else Speeds.from_json(doc.get("speeds"), ask.device)
    if doc is None or speeds is None:
        return Speeds.assumed(ask.device, f"not measured on {where}: {reason or 'the node printed no readable result'}")
    if doc.get("new") is True and ask.cache is not None:
        hosts[identity] = speeds_document(doc.get("kept"))
        _save_hosts(ask.cache, hosts, identity)
    return _said_on(speeds, where)


def _result(output: str, exit_status: int | None, timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """(the node's result document, why there is none) from the script's output."""
    doc: dict[str, Any] | None = None
    status: str | None = None
    lines = output.splitlines()
    for line in lines:
        if line.startswith(f"{_MARK} json "):
            with contextlib.suppress(ValueError):
                found = json.loads(line.split(" json ", 1)[1])
                doc = found if isinstance(found, dict) else None
        elif line.startswith(f"{_MARK} rc "):
            status = line.split(" rc ", 1)[1].strip()
    if doc is not None and "error" in doc:
        return None, str(doc["error"])[:300]
    if doc is not None:
        return doc, None
    said = " ".join(line for line in lines if not line.startswith(_MARK))[-300:]
    if status in ("124", "137"):
        return None, f"the measurement did not finish within {timeout_s:g} s and was stopped"
    if status is None:  # the script ended before the measurement: a setup line failed (`SETUP_FAILED_STATUS`)
        return None, f"the node's script ended with exit status {exit_status}: {said}"
    return None, f"the measurement ended with exit status {status}: {said}"


def _said_on(speeds: Speeds, where: str) -> Speeds:
    """`speeds` with each measured one said to be measured on `where`, each assumed one said to be assumed there."""

    def said(how: str) -> str:
        if how.startswith("measured"):
            return f"measured on {where}{how.removeprefix('measured')}"
        if how.startswith("assumed ("):
            return f"assumed (on {where}: {how.removeprefix('assumed (')}"
        return how

    return Speeds(
        speeds.read_bytes_per_s,
        said(speeds.read_how),
        speeds.flops_per_s,
        said(speeds.compute_how),
        speeds.read_measured,
        speeds.compute_measured,
        speeds.read_cached,
    )


def _load_hosts(cache: Path | None) -> dict[str, Any]:
    """The kept speeds of every node ({identity: cache document}); empty when absent, too large or unreadable."""
    found = read_kept(cache)
    hosts = found.get("hosts") if isinstance(found, dict) else None
    return dict(hosts) if isinstance(hosts, dict) else {}


def _save_hosts(cache: Path, hosts: dict[str, Any], identity: str) -> None:
    """Write every node's kept speeds (only `identity`'s where all of them are over the cache's bound)."""
    doc = {"hosts": hosts}
    if len(json.dumps(doc)) > MAX_CACHE_BYTES:
        doc = {"hosts": {identity: hosts[identity]}}
    with contextlib.suppress(OSError):
        atomic_write_json(cache, doc)
