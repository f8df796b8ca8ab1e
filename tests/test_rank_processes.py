"""The process-per-rank launcher that the trainer and the replay share: real gloo groups on this machine."""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.rank_processes import RankProcessError, spawn_ranks


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
    if rank == 1:  # after its work, the final barrier and the group's teardown: a native abort as the process exits
        atexit.register(os.abort)


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
from axrl_spike_replay.capture.reference_trainer import capture_reference_run

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
