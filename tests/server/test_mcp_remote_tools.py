"""GPU-node work through MCP against a real SSH server on loopback: probe the node, replay there with its progress
streamed, refuse an unknown host key, and cancel a running remote job so that nothing is left running."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client
from server_helpers import SpikeOutputs, call, error_text, ok

from axrl_spike_replay.server import create_server

pytestmark = pytest.mark.processes  # an SSH server on loopback, and the replays and commands it runs


def _processes(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


def _wait_for_child(marker: str, seconds: float = 10.0) -> list[str]:
    """The processes of `marker` once its child shows in the process table (a loaded machine can list it late)."""
    deadline = time.monotonic() + seconds
    found = _processes(marker)
    while not any(line.endswith(f"{marker}-child") for line in found) and time.monotonic() < deadline:
        time.sleep(0.05)
        found = _processes(marker)
    return found


def _wait_until_gone(marker: str, seconds: float = 15.0) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := _processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_probe_node_reports_the_node_and_the_replay_plan(
    ssh_node, isolated_home: Path, spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    report = ok(
        call(
            workspace,
            "probe_node",
            {"target": ssh_node.spec(), "remote_python": sys.executable, "snapshot": str(spike_outputs.snapshot)},
        )
    )
    assert report["gpu_count"] == 0 and report["python_version"] and report["package_importable"] is True
    assert report["world_size_saved"] == 2 and report["fits_full_fidelity"] is False
    assert "CPU" in report["plan"]


def test_an_unknown_host_key_is_refused_with_its_fingerprint(ssh_node, isolated_home: Path, workspace: Path) -> None:
    empty = isolated_home / "known_hosts"
    empty.write_text("")
    text = error_text(call(workspace, "probe_node", {"target": ssh_node.spec(known_hosts=empty)}))
    assert "SHA256:" in text and "accept" in text.lower()
    assert empty.read_text() == ""


def test_a_remote_replay_streams_progress_and_matches_the_local_one(
    ssh_node, isolated_home: Path, spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    local = ok(call(workspace, "replay", {"snapshot": str(spike_outputs.snapshot)}))
    lines: list[str] = []

    async def body():
        async with Client(create_server(workspace)) as client:

            async def on_progress(value: float, total: float | None, message: str | None) -> None:
                lines.append(message or "")

            return await client.call_tool(
                "replay",
                {"snapshot": str(spike_outputs.snapshot), "target": ssh_node.spec(), "remote_python": sys.executable},
                progress_callback=on_progress,
            )

    remote = ok(anyio.run(body))
    assert remote["grad_norm"] == local["grad_norm"] and remote["target"] == ssh_node.spec()
    assert remote["node"]["gpu_count"] == 0
    assert any(line.startswith("[") for line in lines), lines  # the node's own lines, tagged with the target


def test_cancelling_a_remote_call_kills_its_process_group(
    ssh_node, isolated_home: Path, spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    marker = f"axrl-mcp-cancel-{secrets.token_hex(6)}"
    sleeper = workspace / "sleeper.py"
    sleeper.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', sys.argv[1] + '-child'])\n"
        "print(sys.argv[1], 'running', flush=True)\n"
        "time.sleep(120)\n"
    )
    (workspace / "spike-replay.yaml").write_text(
        "command_backend:\n"
        f"  workdir: {workspace}\n"
        f"  command: {sys.executable} {sleeper} {marker} {{snapshot}} {{out}}\n"
    )
    ok(call(workspace, "task_open", {"job": "fx-server-moe"}))
    seen: list[str] = []
    running: list[str] = []

    async def body() -> None:
        async with Client(create_server(workspace)) as client:
            with anyio.CancelScope() as scope:

                async def on_progress(value: float, total: float | None, message: str | None) -> None:
                    seen.append(message or "")
                    if f"{marker} running" in (message or ""):  # the sleeper's own line, not any progress line
                        running.extend(_wait_for_child(marker))
                        scope.cancel()

                await client.call_tool(
                    "replay",
                    {"snapshot": str(spike_outputs.snapshot), "target": ssh_node.spec(), "backend": "command"},
                    progress_callback=on_progress,
                )
            assert scope.cancelled_caught

    anyio.run(body)
    assert any(f"{marker} running" in line for line in seen)
    assert any(line.endswith(f"{marker}-child") for line in running), running  # it was running when cancelled
    assert _wait_until_gone(marker) == []
    # The server finishes its clean-up (the failed attempt in the task file) after the client stopped waiting.
    deadline = time.monotonic() + 15.0
    while not (failed := ok(call(workspace, "task_show", {"job": "fx-server-moe"}))["failed"]):
        assert time.monotonic() < deadline, "the cancelled attempt never reached the task file"
        time.sleep(0.05)
    assert any("cancel" in f["reason"] for f in failed), failed


def test_a_target_s_config_file_is_refused_before_anything_in_it_runs(workspace: Path, tmp_path: Path) -> None:
    """`-F FILE` would hand asyncssh a file whose ProxyCommand (and `Match exec`, run while the file is read) runs
    here as the server's user: `-o ProxyCommand` is refused, and so is the file that says the same."""
    ran = [tmp_path / "match-exec-ran", tmp_path / "proxy-command-ran"]
    config = tmp_path / "ssh_config"
    config.write_text(f'Match exec "touch {ran[0]}"\nHost *\n  ProxyCommand touch {ran[1]}\n')
    for tool in ("probe_node", "plan_replay"):
        arguments = {"target": f"ssh -F {config} gpu-node"} | ({"snapshot": "s"} if tool == "plan_replay" else {})
        text = error_text(call(workspace, tool, arguments))
        assert "-F (an ssh config file) is refused" in text and "~/.ssh/config" in text, text
    assert not any(path.exists() for path in ran)
