"""The MCP server keeps its replay processes warm: later calls give the cold replay's exact numbers on the same
processes, a rewritten snapshot is loaded again, a killed rank process is replaced, a cancelled call leaves the
pool usable, an idle pool shuts down, and the server's exit takes every replay process with it."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from server_helpers import SpikeOutputs, ok, server_command, with_client

from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.processes.rank_processes import RunCancelled
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.warm_pool import ModelCache, WarmService
from axrl_spike_replay.server import create_server


def _same_numbers(a: dict[str, Any], b: Any) -> None:
    assert a["grad_norm"] == b.grad_norm  # bit-identical, not close
    assert a["top_params"] == [p.to_json() for p in b.top_params]
    assert a["rank_metrics"] == b.rank_metrics


@pytest.mark.slow  # starts warm replay processes
def test_warm_replays_match_a_cold_replay_bit_for_bit_on_the_same_processes(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    server = create_server(workspace)
    warm = server.config.warm
    assert warm is not None
    seen: list[list[int]] = []

    async def body(client: Client) -> list[dict[str, Any]]:
        results = []
        for mitigations in ({}, {}, {"advantage_clip": 0.5}):
            args = {"snapshot": str(spike_outputs.snapshot), "mitigations": mitigations}
            results.append(ok(await client.call_tool("replay", args)))
            seen.append([pid for pids in warm.pools().values() for pid in pids])
        return results

    first, second, mitigated = with_client(server, body)
    assert len(seen[0]) == 2 and seen[0] == seen[1] == seen[2]  # one pool of two processes, kept
    assert warm.pools() == {}  # the session ended: its processes were stopped
    cold = run_replay(replay_request(What(spike_outputs.snapshot)))
    cold_mitigated = run_replay(replay_request(What(spike_outputs.snapshot, mitigations={"advantage_clip": 0.5})))
    _same_numbers(first, cold)
    _same_numbers(second, cold)
    _same_numbers(mitigated, cold_mitigated)
    assert first["verdict"] == cold.verdict and mitigated["verdict"] == cold_mitigated.verdict


def test_a_touched_or_rewritten_weights_file_is_loaded_again(spike_outputs: SpikeOutputs) -> None:
    from axrl_spike_replay.replay.reading.inputs import load_inputs

    snapshot = spike_outputs.snapshot
    model_cfg = load_inputs(snapshot, str(snapshot), False).model
    cache = ModelCache(1 << 30)
    cache.model(model_cfg, str(snapshot), "cpu")
    cache.model(model_cfg, str(snapshot), "cpu")
    assert (cache.loads, cache.hits) == (1, 1)

    [shard, *_] = sorted(snapshot.glob("*.distcp"))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched
    cache.model(model_cfg, str(snapshot), "cpu")
    assert cache.loads == 2

    copy = shard.with_name(shard.name + ".new")  # rewritten in place of the old file, as a writer would
    shutil.copyfile(shard, copy)
    copy.replace(shard)
    rebuilt = cache.model(model_cfg, str(snapshot), "cpu")
    assert cache.loads == 3
    assert cache.model(model_cfg, str(snapshot), "cpu") is rebuilt and cache.hits == 2


def test_the_cache_keeps_within_its_memory_budget(spike_outputs: SpikeOutputs) -> None:
    from axrl_spike_replay.replay.reading.inputs import load_inputs

    snapshot = spike_outputs.snapshot
    model_cfg = load_inputs(snapshot, str(snapshot), False).model
    cache = ModelCache(0)  # nothing fits: every call loads, nothing is kept
    cache.model(model_cfg, str(snapshot), "cpu")
    cache.model(model_cfg, str(snapshot), "cpu")
    assert (cache.loads, cache.hits, len(cache)) == (2, 0, 0)


def test_the_cache_lets_go_of_the_least_recently_used_model_first(spike_outputs: SpikeOutputs, tmp_path: Path) -> None:
    from axrl_spike_replay.replay.reading.inputs import load_inputs

    first = spike_outputs.snapshot
    second = tmp_path / "second" / first.name  # the same weights under another dir: another cache entry
    shutil.copytree(first, second)
    model_cfg = load_inputs(first, str(first), False).model
    sizing = ModelCache(1 << 30)
    model = sizing.model(model_cfg, str(first), "cpu")
    one_model = sum(t.numel() * t.element_size() for t in model.state_dict().values())

    cache = ModelCache(one_model + one_model // 2)  # room for one model, not two
    cache.model(model_cfg, str(first), "cpu")
    cache.model(model_cfg, str(second), "cpu")  # the first is let go
    assert (cache.loads, len(cache)) == (2, 1)
    cache.model(model_cfg, str(second), "cpu")
    assert cache.hits == 1
    cache.model(model_cfg, str(first), "cpu")
    assert (cache.loads, cache.hits, len(cache)) == (3, 1, 1)


@pytest.mark.slow  # starts warm replay processes
def test_an_idle_pool_shuts_down_and_the_next_call_starts_a_fresh_one(spike_outputs: SpikeOutputs) -> None:
    warm = WarmService(idle_s=1.0)
    try:
        first = run_replay(replay_request(What(spike_outputs.snapshot)), runner=warm.run_job)
        [pids] = warm.pools().values()
        deadline = time.monotonic() + 60
        while warm.pools() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert warm.pools() == {}
        for pid in pids:
            _wait_gone(pid)
        assert not any(_alive(pid) for pid in pids)
        again = run_replay(replay_request(What(spike_outputs.snapshot)), runner=warm.run_job)
        [fresh] = warm.pools().values()
        assert set(fresh).isdisjoint(pids) and again.grad_norm == first.grad_norm
    finally:
        warm.close()


@pytest.mark.slow  # starts warm replay processes
def test_a_killed_rank_process_is_noticed_and_the_pool_restarted(spike_outputs: SpikeOutputs) -> None:
    warm = WarmService()
    try:
        first = run_replay(replay_request(What(spike_outputs.snapshot)), runner=warm.run_job)
        [old] = warm.pools().values()
        os.kill(old[1], signal.SIGKILL)
        _wait_gone(old[1])
        lines: list[str] = []
        second = run_replay(replay_request(What(spike_outputs.snapshot), progress=lines.append), runner=warm.run_job)
        [new] = warm.pools().values()
        assert set(new).isdisjoint(old) and warm.restarts == 1
        assert any("restart" in line for line in lines), lines
        assert second.grad_norm == first.grad_norm
        assert not _alive(old[0])  # its peer was stopped with it
    finally:
        warm.close()


@pytest.mark.slow  # starts warm replay processes
def test_a_cancelled_warm_replay_leaves_the_pool_usable(spike_outputs: SpikeOutputs, tmp_path: Path) -> None:
    warm = WarmService()
    try:
        expected = run_replay(replay_request(What(spike_outputs.snapshot)), runner=warm.run_job)
        [pids] = warm.pools().values()
        cancel = threading.Event()

        def cancel_once_loaded(line: str) -> None:
            if "loaded" in line:
                cancel.set()

        request = replay_request(What(spike_outputs.snapshot), cancel=cancel, progress=cancel_once_loaded)
        with pytest.raises(RunCancelled):
            run_replay(request, runner=warm.run_job)
        assert list(warm.pools().values()) == [pids]  # the same processes, still up
        again = run_replay(replay_request(What(spike_outputs.snapshot)), runner=warm.run_job)
        assert again.grad_norm == expected.grad_norm
        assert list(warm.pools().values()) == [pids]
    finally:
        warm.close()
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.slow  # starts warm replay processes
def test_the_server_stops_its_replay_processes_when_it_exits(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    cmd = server_command()
    params = StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])
    during: dict[str, list[int]] = {}

    async def session() -> None:
        async with Client(params) as client:
            ok(await client.call_tool("replay", {"snapshot": str(spike_outputs.snapshot)}))
            [server] = [pid for pid in _children(os.getpid()) if f"mcp --workspace {workspace}" in _cmdline(pid)]
            during["server"] = [server]
            during["ranks"] = _descendants(server)

    anyio.run(session)
    assert len(during["ranks"]) >= 2, during  # the two warm replay processes were up between calls
    deadline = time.monotonic() + 60
    left = [pid for pid in [*during["server"], *during["ranks"]] if _alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [pid for pid in left if _alive(pid)]
    assert not left, [(pid, _cmdline(pid)) for pid in left]


def _proc_status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _alive(pid: int) -> bool:
    """In the process table and not a zombie."""
    state = _proc_status(pid).get("State", "")
    return bool(state) and not state.startswith("Z")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(parent: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _proc_status(int(entry.name)).get("PPid", "").strip() == str(parent):
            out.append(int(entry.name))
    return out


def _descendants(parent: int) -> list[int]:
    found, todo = [], [parent]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
