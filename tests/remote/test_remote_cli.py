"""The CLI face of remote runs: `replay --target ... --backend command --patch ...`, and Ctrl-C on a node."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from remote_helpers import PATCH, SLOW_SCRIPT, git, wait_until_gone, workspace_with
from ssh_loopback import LoopbackServer


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "axrl_spike_replay", *args], capture_output=True, text=True)


def test_replay_with_the_command_backend_and_a_patch_over_ssh(
    openssh_server: LoopbackServer, training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    ws = workspace_with(tmp_path, training_checkout, openssh_server)
    patch = tmp_path / "fix.diff"
    patch.write_text(PATCH)
    args = ["replay", str(snapshot), "--backend", "command", "--target", "loop", "--patch", str(patch)]
    done = cli(*args, "--workspace", str(ws), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["verdict"] == "cleared" and doc["backend"] == "command" and doc["target"] == "loop"
    assert doc["patch_sha256"] and doc["node"]["gpu_count"] == 0
    assert "[loop] reproduce_spike: iteration 21" in done.stderr  # the node's output, streamed as it ran
    assert git(training_checkout, "status", "--porcelain") == ""


def test_ctrl_c_stops_the_node_and_keeps_a_failed_result(
    openssh_server: LoopbackServer, training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    marker = f"axrl-cli-{secrets.token_hex(6)}"
    (training_checkout / "tools" / "slow_replay.py").write_text(SLOW_SCRIPT)
    ws = workspace_with(tmp_path, training_checkout, openssh_server)
    config = (ws / "spike-replay.yaml").read_text()
    (ws / "spike-replay.yaml").write_text(config.replace("tools/reproduce_spike.py", f"tools/slow_replay.py {marker}"))
    command = ["replay", str(snapshot), "--backend", "command", "--target", "loop", "--workspace", str(ws)]
    process = subprocess.Popen(
        [sys.executable, "-m", "axrl_spike_replay", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    runs = ws / "tmp" / "spike-replay" / "cmd-job"
    deadline = time.monotonic() + 60
    while not any("started" in p.read_text() for p in runs.glob("*/stdout.log")):
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in err
    assert wait_until_gone(marker) == []
    doc = json.loads(next(runs.glob("*/replay_result.json")).read_text())
    assert doc["verdict"] == "failed" and doc["error"].startswith("cancelled")
    assert "started" in next(runs.glob("*/stdout.log")).read_text()


def test_remote_only_options_on_a_local_torch_replay_are_refused(snapshot: Path, tmp_path: Path) -> None:
    done = cli("replay", str(snapshot), "--patch", "fix.diff", "--workspace", str(tmp_path))
    assert done.returncode == 2 and "add --backend command" in done.stderr and "Traceback" not in done.stderr
