"""`plan --target` an SSH node: the streamed row's time at that node's read and compute speeds, measured on the node
over the probe's connection by the same measurement a plan here runs, kept here per node (by its host key, not by
this machine's name) so that the next plan reuses them, and measured again where an entry is stale or unreadable.
A node without a copy of the snapshot measures its read on a temporary file it removes; a measurement that fails
(no space, a read-only disk, a timeout) leaves the assumed speeds with the reason and no file behind.

The nodes are loopback OpenSSH sshds; the one "without the snapshot" is an sshd in its own mount namespace, where an
empty directory hides the snapshot and tiny or read-only tmpfs mounts stand for its replay disk.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

from replay_launch_helpers import blind_node, copy_snapshot, node_entry, write_workspace
from ssh_loopback import LoopbackServer

import axrl_spike_replay
from axrl_spike_replay.investigation.planning import NODE_SPEEDS, NODE_SPEEDS_REMOTE, plan_for
from axrl_spike_replay.remote.transport.options import RemoteOptions
from axrl_spike_replay.remote.transport.session import open_session
from axrl_spike_replay.remote.workspace_config import load_workspace_config, resolve_target
from axrl_spike_replay.replay.plans.read_speed import checkpoint_data_file
from axrl_spike_replay.replay.streamed.speeds import ASSUMED_READ_BYTES_PER_S
from axrl_spike_replay.replay.streamed.streamed_plan import StreamedRow
from axrl_spike_replay.workspace.paths import TMP_DIR

PACKAGE_ROOT = Path(axrl_spike_replay.__file__).resolve().parents[1]
WITH_PACKAGE = f"export PYTHONPATH={PACKAGE_ROOT}"  # the node's python imports this tree's package
HOST = socket.gethostname()


def _row(snapshot: Path, ws: Path, target: str = "node", **options: float) -> StreamedRow:
    row = plan_for(snapshot, target=target, workspace=ws, options=RemoteOptions(**options)).streamed
    assert row is not None
    return row


def _kept(ws: Path) -> dict:
    return json.loads((ws / TMP_DIR / NODE_SPEEDS_REMOTE).read_text())["hosts"]


def test_a_plan_for_an_ssh_node_measures_its_speeds_there_and_the_next_plan_reuses_them(
    openssh_server: LoopbackServer, tmp_path: Path, cli
) -> None:
    snapshot = copy_snapshot(tmp_path)
    ws = write_workspace(tmp_path / "ws", {"node": node_entry(openssh_server, setup=(WITH_PACKAGE,))})
    done = cli("plan", snapshot, "--target", "node", "--workspace", ws, "--json")
    assert done.code == 0, done.err
    first = done.json()["streamed"]
    assert first["read_measured"] and first["compute_measured"]
    data = checkpoint_data_file(snapshot)
    assert data is not None
    # said as measured on the node, with what: the snapshot's own file there, disk or page cache, dtype and device
    assert f"read {first['read_bytes_per_s'] / 1e9:.3g} GB/s measured on {HOST}, " in first["speeds"]
    assert f"of {data.name} from " in first["speeds"] and "assumed" not in first["speeds"]
    assert f"measured on {HOST}, 512x512 float32 matmul on cpu, 1 thread" in first["speeds"]
    assert not (ws / TMP_DIR / NODE_SPEEDS).exists()  # nothing measured here: this machine's cache is untouched
    kept = _kept(ws)
    [(identity, entries)] = kept.items()
    assert identity.startswith(f"{HOST} SHA256:")  # the node's host key, not this machine's name alone
    assert [e["bytes_per_s"] for e in entries["read"].values()] == [first["read_bytes_per_s"]]
    assert [e["flops_per_s"] for e in entries["compute"].values()] == [first["flops_per_s"]]
    cache = ws / TMP_DIR / NODE_SPEEDS_REMOTE
    written = cache.stat().st_mtime_ns

    second = _row(snapshot, ws)
    # the same figures to the last bit (a second measurement would differ), said as kept; the file not rewritten
    assert (second.read_bytes_per_s, second.flops_per_s) == (first["read_bytes_per_s"], first["flops_per_s"])
    assert second.speeds.count("kept from") == 2 and second.speeds.count(f"measured on {HOST}") == 2
    assert cache.stat().st_mtime_ns == written

    # a stale read (measured eight days ago) and an unreadable compute speed are measured again, not trusted
    for entry in entries["read"].values():
        entry["epoch"] -= 8 * 24 * 3600
    for entry in entries["compute"].values():
        entry["flops_per_s"] = "fast"
    cache.write_text(json.dumps({"hosts": kept}))
    third = _row(snapshot, ws)
    assert third.read_measured and third.compute_measured and "kept from" not in third.speeds
    again = _kept(ws)[identity]
    assert [e["bytes_per_s"] for e in again["read"].values()] == [third.read_bytes_per_s]
    assert [e["flops_per_s"] for e in again["compute"].values()] == [third.flops_per_s]


def _left_on_node(ws: Path, target: str, directory: Path) -> list[str]:
    """What `directory` holds as the node sees it (its own mounts), listed over SSH."""
    resolved = resolve_target(target, load_workspace_config(ws), None)

    async def listing() -> list[str]:
        async with await open_session(resolved.ssh) as session:
            got = await session.capture(f"ls -A {directory}")
            assert got.exit_status == 0, got.stderr
            return got.stdout.split()

    return asyncio.run(listing())


def test_a_node_without_the_snapshot_measures_a_temporary_file_on_its_disk_and_leaves_none(
    openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    snapshot = copy_snapshot(tmp_path)
    disk = tmp_path / "node-tmp"
    disk.mkdir()
    blind, server = blind_node(tmp_path, openssh_server, snapshot, "true")
    try:
        setup = (WITH_PACKAGE, f"export TMPDIR={disk}")
        ws = write_workspace(tmp_path / "ws", {"node": node_entry(server, setup=setup)})
        row = _row(snapshot, ws)
        left = _left_on_node(ws, "node", disk)
    finally:
        blind.stop()
    assert row.read_measured and row.compute_measured
    assert f"measured on {HOST}, 64 MiB of a temporary file written in {disk} (no copy of the snapshot's" in row.speeds
    assert left == [] and list(disk.iterdir()) == []  # written, read and removed


def test_a_measurement_that_fails_keeps_the_assumed_speeds_with_the_reason_and_leaves_no_file(
    openssh_server: LoopbackServer, tmp_path: Path
) -> None:
    snapshot = copy_snapshot(tmp_path)
    full, read_only = tmp_path / "full", tmp_path / "read-only"
    full.mkdir()
    read_only.mkdir()
    # the node's replay disks: one with 1 MiB of room (the 64 MiB file does not fit), one read-only
    mounts = f"mount -t tmpfs -o size=1m tmpfs {full} && mount -t tmpfs -o ro,size=1m tmpfs {read_only}"
    blind, server = blind_node(tmp_path, openssh_server, snapshot, mounts)
    hang = tmp_path / "hanging-python"  # a node whose measurement never ends: it is stopped at the timeout
    module = "axrl_spike_replay.replay.plans.node_speeds_main"
    hang.write_text(f'#!/bin/sh\nif [ "$2" = {module} ]; then exec sleep 600; fi\nexec {sys.executable} "$@"\n')
    hang.chmod(0o755)
    try:
        targets = {
            "full": node_entry(server, setup=(WITH_PACKAGE, f"export TMPDIR={full}")),
            "read-only": node_entry(server, setup=(WITH_PACKAGE, f"export TMPDIR={read_only}")),
            "hanging": node_entry(server, python=str(hang), setup=(WITH_PACKAGE, f"export TMPDIR={full}")),
        }
        ws = write_workspace(tmp_path / "ws", targets)
        no_space = _row(snapshot, ws, "full")
        left_full = _left_on_node(ws, "full", full)
        no_write = _row(snapshot, ws, "read-only")
        hanging = _row(snapshot, ws, "hanging", timeout_s=3)
        left_hanging = _left_on_node(ws, "hanging", full)
    finally:
        blind.stop()
    # the compute speed is still the node's; the read is assumed, saying why
    assert no_space.compute_measured and not no_space.read_measured
    assert no_space.read_bytes_per_s == ASSUMED_READ_BYTES_PER_S
    assert f"read 2 GB/s assumed (on {HOST}: no copy of the snapshot's weights here, and a temporary file in" in (
        no_space.speeds
    )
    assert "No space left on device" in no_space.speeds
    assert no_write.compute_measured and not no_write.read_measured
    assert "no temporary directory could be made: mktemp: " in no_write.speeds
    assert "Read-only file system" in no_write.speeds
    assert not hanging.read_measured and not hanging.compute_measured
    assert "not measured on" in hanging.speeds and "did not finish within 3 s and was stopped" in hanging.speeds
    assert left_full == [] and left_hanging == []
    kept = _kept(ws)
    assert all(not entries["read"] for entries in kept.values())  # no failed read kept
