"""The process-per-rank launcher that the trainer and the replay share: real gloo groups on this machine."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.processes.rank_processes import RankProcessError, spawn_ranks


def _all_reduce_ranks(rank: int, nproc: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    Path(out, f"rank{rank}.txt").write_text(f"{value.item():g}")


def _abort_once(rank: int, nproc: int, out: str) -> None:
    marker = Path(out, "aborted-once")
    if rank == 1 and not marker.exists():
        marker.touch()
        os.abort()  # a native crash: no Python traceback, no report file
    Path(out, f"rank{rank}.txt").write_text("done")


def _abort_in_teardown(rank: int, nproc: int, out: str) -> None:
    _all_reduce_ranks(rank, nproc, out)
    if rank == 1:  # after its work and the final barrier: a native abort in the group's teardown
        import torch.distributed as dist

        destroy = dist.destroy_process_group

        def destroy_then_abort(*args: object, **kwargs: object) -> None:
            destroy(*args, **kwargs)  # type: ignore[arg-type]
            os.abort()

        dist.destroy_process_group = destroy_then_abort  # the launcher's teardown calls it through the module


def _refuse(rank: int, nproc: int, out: str) -> None:
    raise AxrlError(f"rank {rank} found nothing to do in {out}")


def test_every_rank_joins_one_process_group(tmp_path: Path) -> None:
    spawn_ranks(_all_reduce_ranks, 3, str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.glob("rank*.txt")) == ["6", "6", "6"]


def test_a_native_crash_is_reported_with_its_signal(tmp_path: Path) -> None:
    with pytest.raises(RankProcessError, match="SIGABRT"):
        spawn_ranks(_abort_once, 2, str(tmp_path))


def test_a_rank_that_aborts_in_teardown_after_every_rank_finished_loses_no_work(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The capture's exit crash: every rank wrote its results, then one died from SIGABRT while tearing down. The
    run stands (its results are complete) and the launcher says what happened."""
    with caplog.at_level(logging.WARNING, logger="axrl_spike_replay.ranks"):
        spawn_ranks(_abort_in_teardown, 2, str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.glob("rank*.txt")) == ["3", "3"]
    assert "died from a signal while tearing down, after every rank finished its work" in caplog.text


def test_side_effect_free_work_survives_one_native_crash(tmp_path: Path) -> None:
    spawn_ranks(_abort_once, 2, str(tmp_path), native_crash_retries=1)
    assert (tmp_path / "aborted-once").exists()
    assert sorted(p.name for p in tmp_path.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]


def test_expected_errors_come_back_with_the_rank_s_message_and_are_not_retried(tmp_path: Path) -> None:
    with pytest.raises(AxrlError, match="found nothing to do"):
        spawn_ranks(_refuse, 2, str(tmp_path), native_crash_retries=3)


SCRIPT = """
from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run

{body}
"""
CALL = 'capture_reference_run("out", world_size=2, steps=2, preset="none")'


def _run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "my_capture.py"
    script.write_text(SCRIPT.format(body=body))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "mcp_server")}
    return subprocess.run(
        [sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path: Path) -> None:
    """Spawned rank processes import the script again: without the guard each would start the run anew."""
    run = _run_script(tmp_path, CALL)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "my_capture.py" in last and 'if __name__ == "__main__":' in last, run.stderr
    assert "a rank process died" not in last

    guarded = _run_script(tmp_path / "..", f'if __name__ == "__main__":\n    {CALL}')  # what the message says to do
    assert guarded.returncode == 0, guarded.stderr


def _rebuild_only_in_the_launcher(launcher: int) -> _Payload:
    if os.getpid() != launcher:
        raise RuntimeError("this payload cannot be rebuilt in a rank process")
    return _Payload()


class _Payload:
    """A payload that fails to unpickle in a spawned process: it dies before any of our code runs there."""

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return (_rebuild_only_in_the_launcher, (os.getpid(),))


def test_ranks_that_die_while_starting_say_so(tmp_path: Path) -> None:
    with pytest.raises(RankProcessError, match="rank processes died while starting") as raised:
        spawn_ranks(_all_reduce_ranks, 2, _Payload())
    assert "before any ran its work" in str(raised.value)


def _report_parent(rank: int, nproc: int, out: str) -> None:
    Path(out, f"parent{rank}.txt").write_text(str(os.getppid()))


def _process_server() -> int:
    """The process server this process launched (multiprocessing's forkserver), by its command line."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or f"\nPPid:\t{os.getpid()}\n" not in (entry / "status").read_text():
                continue
            if b"multiprocessing.forkserver" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except OSError:
            continue
    raise AssertionError("no process server among this process's children")


def test_ranks_fork_from_a_server_that_has_torch_loaded_and_runs_one_thread(tmp_path: Path) -> None:
    """The server imports torch once and runs nothing: no intra-op pool, no thread to lose at the fork."""
    spawn_ranks(_report_parent, 2, str(tmp_path))
    server = _process_server()
    assert {p.read_text() for p in tmp_path.glob("parent*.txt")} == {str(server)}  # forked there, not here
    assert "libtorch_cpu" in Path(f"/proc/{server}/maps").read_text()  # torch is imported in the server ...
    assert len(list(Path(f"/proc/{server}/task").iterdir())) == 1  # ... and it runs a single thread


def test_spawn_is_used_when_asked_and_its_ranks_meet_as_well(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where no process server can run: each rank a fresh Python, a child of this process."""
    monkeypatch.setenv("AXRL_START_METHOD", "spawn")
    spawn_ranks(_all_reduce_ranks, 2, str(tmp_path))
    spawn_ranks(_report_parent, 2, str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.glob("rank*.txt")) == ["3", "3"]
    assert {p.read_text() for p in tmp_path.glob("parent*.txt")} == {str(os.getpid())}


def test_an_unknown_start_method_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXRL_START_METHOD", "fork")
    with pytest.raises(AxrlError, match=r"AXRL_START_METHOD='fork'.*forkserver, spawn"):
        spawn_ranks(_all_reduce_ranks, 2, str(tmp_path))


def test_ranks_see_the_launcher_s_environment_as_it_is_when_they_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server was started earlier, with the environment of then: a rank still sees this one."""
    spawn_ranks(_report_parent, 1, str(tmp_path))  # the server runs
    monkeypatch.setenv("AXRL_TEST_MARK", str(tmp_path))
    spawn_ranks(_report_environment, 2, str(tmp_path))
    assert {p.read_text() for p in tmp_path.glob("mark*.txt")} == {str(tmp_path)}


def _report_environment(rank: int, nproc: int, out: str) -> None:
    Path(out, f"mark{rank}.txt").write_text(os.environ.get("AXRL_TEST_MARK", "unset"))


LAUNCHER = """
import sys, time
from pathlib import Path
from axrl_spike_replay.processes.rank_processes import spawn_ranks

def wait_forever(rank, nproc, out):
    Path(out, f"up{rank}").touch()
    time.sleep(600)

if __name__ == "__main__":
    spawn_ranks(wait_forever, 2, sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_launcher_killed_with_sigkill_takes_the_server_and_every_rank_with_it(tmp_path: Path, method: str) -> None:
    """No orphan: the ranks' parent is the server (or the launcher, under spawn), and both go with the launcher."""
    import signal
    import time

    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "mcp_server")}
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env={**env, "AXRL_START_METHOD": method})
    deadline = time.monotonic() + 300
    while len(list(tmp_path.glob("up*"))) < 2:
        assert launcher.poll() is None and time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    started = _descendants(launcher.pid)
    ranks = [pid for pid in started if _parent(pid) != launcher.pid]
    assert len(ranks) == (2 if method == "forkserver" else 0), started  # forked by the server, or children here

    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=60)
    deadline = time.monotonic() + 60
    while (left := [pid for pid in started if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left]


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    line = next((x for x in _status(pid).splitlines() if x.startswith("PPid:")), "PPid:\t0")
    return int(line.split()[1])


def _alive(pid: int) -> bool:
    """In the process table and not a zombie (a zombie has exited; only its parent's bookkeeping is left)."""
    status = _status(pid)
    return bool(status) and "\nState:\tZ" not in status


def _descendants(root: int) -> list[int]:
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    children: dict[int, list[int]] = {}
    for pid in pids:
        if _alive(pid):
            children.setdefault(_parent(pid), []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _say_rank(rank: int, nproc: int, out: str) -> None:
    print(f"rank {rank} of {nproc} says hello", file=sys.stderr, flush=True)


def test_ranks_print_to_the_launcher_s_stderr_as_it_is_when_they_start(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The process server may have started under other streams (an earlier run, before a redirect); a rank still
    prints where its launcher's standard error goes now, as a spawned one would."""
    with capfd.disabled():  # the server starts (if it is not up yet) under the streams before this capture
        spawn_ranks(_all_reduce_ranks, 2, str(tmp_path))
    spawn_ranks(_say_rank, 2, str(tmp_path))
    err = capfd.readouterr().err
    assert "rank 0 of 2 says hello" in err and "rank 1 of 2 says hello" in err
