"""Helpers shared by the remote tests: a training checkout with a replay script, snapshots, the process table."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ssh_loopback import LoopbackServer

RECORDED = 56.75
REPLAY_SCRIPT = """\
import argparse, json, os, pathlib
p = argparse.ArgumentParser()
p.add_argument("--snapshot"); p.add_argument("--out"); p.add_argument("--no-json", action="store_true")
a = p.parse_args()
meta = json.loads(pathlib.Path(a.snapshot, "axrl_metadata.json").read_text())
factor = float(pathlib.Path("factor.txt").read_text())
norm = meta["grad_norm"] * factor
print(f"reproduce_spike: iteration {meta['iteration']} grad_norm={norm!r}", flush=True)
if not a.no_json:
    pathlib.Path(a.out, "replay_result.json").write_text(json.dumps({"grad_norm": norm, "device": "cpu"}))
"""
SLOW_SCRIPT = """\
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1] + "-grandchild"])
print("started", flush=True)
time.sleep(600)
"""
PATCH = """\
--- a/factor.txt
+++ b/factor.txt
@@ -1 +1 @@
-1.0
+0.001
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def workspace_with(tmp_path: Path, checkout: Path, server: LoopbackServer | None, extra: str = "") -> Path:
    ws = tmp_path / "workspace"
    ws.mkdir(exist_ok=True)
    targets = ""
    if server is not None:
        targets = (
            f"targets:\n  loop:\n    ssh: {json.dumps(server.spec())}\n    python: {sys.executable}\n"
            "    setup: ['export AXRL_SETUP_RAN=1']\n"
        )
    (ws / "spike-replay.yaml").write_text(
        targets + "command_backend:\n"
        f"  workdir: {json.dumps(str(checkout))}\n"
        f'  command: "{sys.executable} tools/reproduce_spike.py --snapshot {{snapshot}} --out {{out}}{extra}"\n'
    )
    return ws


def make_training_checkout(tmp_path: Path) -> Path:
    """The node's training checkout: a git repo with a replay script whose output a patch can change."""
    repo = tmp_path / "train repo 'x'"
    (repo / "tools").mkdir(parents=True)
    (repo / "tools" / "reproduce_spike.py").write_text(REPLAY_SCRIPT)
    (repo / "factor.txt").write_text("1.0\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "training code")
    return repo


def make_command_snapshot(tmp_path: Path) -> Path:
    """A snapshot's metadata at a path with shell metacharacters (the replay script only reads the metadata)."""
    snap = tmp_path / "shared $(touch PWNED) 'q'" / "iter_0000021"
    snap.mkdir(parents=True)
    meta = {
        "format_version": 1,
        "job_name": "cmd-job",
        "role": "actor",
        "iteration": 21,
        "grad_norm": RECORDED,
        "median_norm": 0.5,
        "spike_ratio": RECORDED / 0.5,
        "detector": {"kind": "median_ratio", "window": 20, "threshold": 5.0},
        "parallel": {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "ep": 1, "etp": 1, "cp": 1},
    }
    (snap / "axrl_metadata.json").write_text(json.dumps(meta))
    return snap


def remote_processes(marker: str) -> list[str]:
    """Command lines of live processes mentioning `marker` (loopback: the node's process table is ours)."""
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


def wait_until_gone(marker: str, seconds: float = 10.0) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := remote_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_marked(marker: str) -> None:
    """SIGKILL the live processes mentioning `marker` (what a failing run left behind; none when it passed)."""
    import contextlib
    import os
    import signal

    for line in remote_processes(marker):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
