"""`--warm` on a Megatron snapshot: the CLI's warm replay service runs route 1 (the transformers policy) in its warm
rank processes, the cold replay's exact numbers and files, and route 2 (`--backend megatron`) in fresh Megatron-core
processes of its own, the cold route 2's numbers; the warm processes outlive a route 2 call and serve the next
route 1 call, and nothing is left running once the service stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from megatron_helpers import CliRun, cli_json

from axrl_spike_replay.investigation.warm_client import service_pid, stop_service
from axrl_spike_replay.investigation.warm_socket import warm_paths
from result_files import result_files, stable

pytestmark = pytest.mark.slow  # a warm service with two rank processes, Megatron-core processes, cold replays


def _cli(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "axrl_spike_replay", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _children(parent: int) -> list[int]:
    """The live processes whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if f"\nPPid:\t{parent}\n" in status and "\nState:\tZ" not in status:
            found.append(int(entry.name))
    return sorted(found)


def _descendants(root: int) -> list[int]:
    """The live processes below `root`: the process server it started and the warm rank processes forked there."""
    found, todo = [], [root]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return sorted(found)


def _replay(snapshot: Path, workspace: Path, *extra: str) -> dict[str, Any]:
    done = _cli("replay", snapshot, "--workspace", workspace, "--json", *extra, cwd=workspace)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_warm_replays_of_a_megatron_snapshot_on_both_routes(
    megatron_capture: Path, megatron_cli_route2: CliRun, tmp_path: Path
) -> None:
    cold_ws, warm_ws = tmp_path / "cold", tmp_path / "warm"
    cold_ws.mkdir()
    warm_ws.mkdir()
    torch_argv = ["replay", megatron_capture, "--workspace", cold_ws, "--json", "--backend", "torch"]
    cold = {"torch": cli_json(torch_argv, cwd=cold_ws), "megatron": megatron_cli_route2.doc}  # cold: in this process
    paths = warm_paths(warm_ws)
    try:
        first = _replay(megatron_capture, warm_ws, "--warm")  # starts the service and its warm rank processes
        service = service_pid(paths)
        assert service is not None
        pool = _descendants(service)
        assert len(pool) >= 2
        native = _replay(megatron_capture, warm_ws, "--warm", "--backend", "megatron")
        assert _descendants(service) == pool  # Megatron-core ran in processes of its own, gone with the call
        again = _replay(megatron_capture, warm_ws, "--warm")
        assert _descendants(service) == pool  # the warm processes served the next route 1 call
        for doc in (first, again):
            assert stable(doc) == stable(cold["torch"])  # bit-identical norms, top params, rank metrics, verdict
            assert result_files(doc["output_dir"]) == result_files(cold["torch"]["output_dir"])
        assert (native["backend"], native["verdict"]) == ("megatron", "reproduced")
        assert stable(native) == stable(cold["megatron"])
        assert result_files(native["output_dir"]) == result_files(cold["megatron"]["output_dir"])
        assert stop_service(paths) == service
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{pid}").exists() for pid in (service, *pool)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(Path(f"/proc/{pid}/status").exists() for pid in pool)  # no rank process outlives it
    finally:
        stop_service(paths)
