"""A job ends with everything it started: children that outlive the command while holding its output, children
that left the process group with `setsid`, on this machine and on a node over SSH (OpenSSH and asyncssh's server).
A job's output lines are capped: a line of many megabytes without a newline is cut, never kept or echoed whole."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from remote_helpers import kill_marked, remote_processes, wait_until_gone
from ssh_loopback import LoopbackServer

from axrl_spike_replay.remote.transport.job import MAX_LINE_BYTES, JobOutcome, Session
from axrl_spike_replay.remote.transport.local_session import LocalSession
from axrl_spike_replay.remote.transport.session import open_session
from axrl_spike_replay.remote.transport.shell import detached_command, job_script, parse_pgid_marker

GUARD_S = 120.0  # a hang guard, far above what any of these jobs needs; never a measured time


def stray_script(marker: str, *, setsid: bool, then: str = "") -> list[str]:
    """A job whose child outlives it (tagged with `marker`), holding the job's stdout and stderr open."""
    code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}-stray"],
                         start_new_session={setsid})
        print("grad_norm=56.75", flush=True)
        {then}
        """
    )
    return [sys.executable, "-c", code]


def run_job(where: str, request: pytest.FixtureRequest, tmp_path: Path, argv: list[str], timeout: float) -> JobOutcome:
    async def story() -> JobOutcome:
        if where == "local":
            return await _run(LocalSession(), tmp_path, argv, timeout)
        server: LoopbackServer = request.getfixturevalue(f"{where}_server")
        async with await open_session(server.spec()) as session:
            return await _run(session, tmp_path, argv, timeout)

    return asyncio.run(story())


async def _run(session: Session, tmp_path: Path, argv: list[str], timeout: float) -> JobOutcome:
    return await session.run(
        job_script(argv), stdout_path=tmp_path / "stdout.log", stderr_path=tmp_path / "stderr.log", timeout=timeout
    )


@pytest.mark.parametrize("setsid", [False, True], ids=["same-group", "setsid"])
@pytest.mark.parametrize("where", ["local", "asyncssh", "openssh"])
def test_a_child_left_running_by_a_finished_command_is_stopped_and_does_not_hold_the_job(
    where: str, setsid: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    marker = f"axrl-stray-{secrets.token_hex(6)}"
    try:
        outcome = run_job(where, request, tmp_path, stray_script(marker, setsid=setsid), GUARD_S)
        assert outcome.ok and outcome.reason is None, outcome.reason  # finished, not "timed out" at the guard
        assert (tmp_path / "stdout.log").read_text() == "grad_norm=56.75\n"
        assert "stopped 1 process(es) the command left running" in (tmp_path / "stderr.log").read_text()
        assert wait_until_gone(marker) == []
    finally:
        kill_marked(marker)


@pytest.mark.parametrize("where", ["local", "asyncssh", "openssh"])
def test_a_timeout_stops_children_that_left_the_process_group(
    where: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    marker = f"axrl-escape-{secrets.token_hex(6)}"
    argv = stray_script(marker, setsid=True, then="time.sleep(600)")
    try:
        outcome = run_job(where, request, tmp_path, argv, 3.0)
        assert not outcome.ok and "timed out after 3 s" in (outcome.reason or "")
        assert wait_until_gone(marker) == []
    finally:
        kill_marked(marker)


def test_a_line_of_many_megabytes_is_cut_with_a_marker_and_never_echoed_whole(tmp_path: Path) -> None:
    code = "import sys; sys.stdout.write('x' * 20_000_000); print(); print('grad_norm=56.75'); sys.stdout.write('y')"
    echoed: list[tuple[str, str]] = []

    async def story() -> JobOutcome:
        return await LocalSession().run(
            job_script([sys.executable, "-c", code]),
            stdout_path=tmp_path / "stdout.log",
            stderr_path=tmp_path / "stderr.log",
            timeout=GUARD_S,
            on_line=lambda stream, line: echoed.append((stream, line)),
        )

    assert asyncio.run(story()).ok
    long_line, norm_line, last = (tmp_path / "stdout.log").read_bytes().split(b"\n")
    mark = f" ... [{20_000_000 - MAX_LINE_BYTES} more bytes of this line dropped]".encode()
    assert len(long_line) == MAX_LINE_BYTES + len(mark) and long_line.endswith(mark)  # lengths: no 20 MB diff
    assert long_line.count(b"x") == MAX_LINE_BYTES
    assert (norm_line, last) == (b"grad_norm=56.75", b"y")
    assert [len(line) for _, line in echoed] == [len(long_line), len(norm_line), 1]


@pytest.mark.parametrize("python3", [True, False], ids=["with-python3", "without-python3"])
def test_the_node_side_command_runs_the_job_with_or_without_python3(python3: bool, tmp_path: Path) -> None:
    """What sshd runs: under the reaper where the node has python3, else in its own process group alone."""
    tools = ["sh", "setsid", "cat", "sleep", *(["python3"] if python3 else [])]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        found = sys.executable if tool == "python3" else shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    marker = f"axrl-node-{secrets.token_hex(6)}"
    # the leftover lives as long as the hang guard: without the reaper, reading the output to its end waits that long
    script = job_script(["sh", "-c", f"echo ran; sh -c 'sleep {GUARD_S:.0f}; :' {marker} & exit 3"])
    node = subprocess.Popen(
        ["/bin/sh", "-c", detached_command(script)],
        env={"PATH": str(bin_dir)},
        stdin=subprocess.PIPE,  # the SSH channel: held open, as sshd holds it while the job runs
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert node.stdout is not None and node.stderr is not None
        if python3:  # the reaper ends the job's leftovers, so its output ends with the job
            out, err = node.stdout.read(), node.stderr.read().decode()
            assert out == b"ran\n" and node.wait(GUARD_S) == 3
            assert err.startswith("@@axrl-pgid ") and "process(es) the command left running" in err
            assert wait_until_gone(marker) == []
        else:  # the leftover keeps its group (and the output) until the group is killed, as before
            assert node.stdout.readline() == b"ran\n"
            pgid = parse_pgid_marker(node.stderr.readline())
            assert pgid is not None and node.wait(GUARD_S) == 3
            assert remote_processes(marker) != []
            os.killpg(pgid, signal.SIGKILL)
    finally:
        if node.stdin is not None:
            node.stdin.close()
        node.wait(GUARD_S)
        kill_marked(marker)
