#!/usr/bin/env python3
"""SSH overhead of remote runs vs local runs, and one reused connection vs a connection per command.

Starts a node on loopback (Debian's OpenSSH sshd when installed, else asyncssh's server) and measures,
side by side and interleaved in one run:

1. a replay of the fixture snapshot: the CLI run here (`python -m axrl_spike_replay replay ... --json`)
   vs the same replay on the node over SSH (connect, GPU probe, run, stream logs, fetch results over SFTP);
2. a small Python command that writes a result file: run here vs over SSH (connect, run, fetch);
3. a sweep of N such commands: one connection reused vs a new connection per command.

Usage: .venv/bin/python benchmarks/bench_ssh_overhead.py [--reps 3] [--sweep 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "remote"))

from ssh_loopback import SSHD, AsyncsshServer, Keys, OpenSshServer, write_known_hosts  # noqa: E402

from axrl_spike_replay.investigation.elsewhere import replay_elsewhere  # noqa: E402
from axrl_spike_replay.investigation.request import What, Where, replay_request  # noqa: E402
from axrl_spike_replay.remote.transport.session import open_session  # noqa: E402
from axrl_spike_replay.remote.transport.shell import job_script  # noqa: E402

SNAPSHOT = ROOT / "tests/fixtures/outputs/fx~fixture-moe__actor/checkpoints/spike_snapshots/iter_0000021"
SMALL = "import json, sys; json.dump({'grad_norm': 1.0}, open(sys.argv[1], 'w'))"


def local_replay(workspace: Path) -> float:
    workspace.mkdir()
    start = time.perf_counter()
    command = [sys.executable, "-m", "axrl_spike_replay", "replay", str(SNAPSHOT), "--json"]
    subprocess.run([*command, "--workspace", str(workspace)], check=True, capture_output=True)
    return time.perf_counter() - start


def remote_replay(spec: str, workspace: Path) -> float:
    workspace.mkdir()
    start = time.perf_counter()
    replay_elsewhere(
        replay_request(
            What(SNAPSHOT),
            where=Where(target=spec, remote_python=sys.executable),
            workspace=workspace,
        )
    )
    return time.perf_counter() - start


def local_small(out: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", SMALL, str(out / "result.json")], check=True)
    (out / "fetched.json").write_bytes((out / "result.json").read_bytes())
    return time.perf_counter() - start


async def remote_small(session, out: Path, index: int) -> None:
    result = out / f"node-result-{index}.json"
    outcome = await session.run(
        job_script([sys.executable, "-c", SMALL, str(result)]),
        stdout_path=out / f"stdout-{index}.log",
        stderr_path=out / f"stderr-{index}.log",
    )
    assert outcome.ok, outcome.reason
    await session.fetch(str(result), out / f"fetched-{index}.json")


async def ssh_small(spec: str, out: Path) -> float:
    start = time.perf_counter()
    async with await open_session(spec) as session:
        await remote_small(session, out, 0)
    return time.perf_counter() - start


async def sweep_reused(spec: str, out: Path, n: int) -> float:
    start = time.perf_counter()
    async with await open_session(spec) as session:
        for i in range(n):
            await remote_small(session, out, i)
    return time.perf_counter() - start


async def sweep_reconnecting(spec: str, out: Path, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        async with await open_session(spec) as session:
            await remote_small(session, out, i)
    return time.perf_counter() - start


def main() -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (default 3)")
    parser.add_argument("--sweep", type=int, default=8, help="commands in the sweep comparison (default 8)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="axrl-bench-ssh-") as tmp:
        root = Path(tmp)
        keys = Keys.make(root / "keys")
        (root / "server").mkdir()
        server = OpenSshServer(root / "server", keys) if SSHD else AsyncsshServer(root / "server", keys)
        kind = "OpenSSH sshd" if SSHD else "asyncssh server"
        known = write_known_hosts(root / "known_hosts", server.port, keys.host_pub)
        spec = f"ssh -p {server.port} -i {keys.client_key} -o UserKnownHostsFile={known} 127.0.0.1"
        try:
            rows = {"local replay": [], "ssh replay": [], "local cmd": [], "ssh cmd": [], "reused": [], "reconnect": []}
            for rep in range(args.reps):
                rows["local replay"].append(local_replay(root / f"ws-local-{rep}"))
                rows["ssh replay"].append(remote_replay(spec, root / f"ws-ssh-{rep}"))
                (root / f"small-{rep}").mkdir()
                rows["local cmd"].append(local_small(root / f"small-{rep}"))
                rows["ssh cmd"].append(asyncio.run(ssh_small(spec, root / f"small-{rep}")))
                (root / f"sweep-{rep}").mkdir()
                rows["reused"].append(asyncio.run(sweep_reused(spec, root / f"sweep-{rep}", args.sweep)))
                rows["reconnect"].append(asyncio.run(sweep_reconnecting(spec, root / f"sweep-{rep}", args.sweep)))
        finally:
            server.stop()
    med = {name: statistics.median(values) for name, values in rows.items()}
    print(f"node: loopback {kind}; median of {args.reps} interleaved repetitions")
    print(
        f"replay of the fixture snapshot (2 ranks, CPU): local CLI {med['local replay']:.2f} s, over SSH "
        f"{med['ssh replay']:.2f} s -> SSH adds {med['ssh replay'] - med['local replay']:+.2f} s "
        f"({med['ssh replay'] / med['local replay']:.2f}x)"
    )
    print(
        f"small python command + result file: local {med['local cmd'] * 1000:.0f} ms, over SSH (connect, run, fetch) "
        f"{med['ssh cmd'] * 1000:.0f} ms ({med['ssh cmd'] / med['local cmd']:.1f}x)"
    )
    print(
        f"sweep of {args.sweep} commands over SSH: one connection reused {med['reused']:.2f} s vs a connection per "
        f"command {med['reconnect']:.2f} s ({med['reconnect'] / med['reused']:.2f}x faster reused)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
