"""Running commands on a node: literal paths, streamed logs, one connection for many commands, clean stops."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest
from remote_helpers import remote_processes, wait_until_gone
from ssh_loopback import LoopbackServer, TcpProxy

from axrl_spike_replay.files.atomic import current_umask
from axrl_spike_replay.remote.transport.connect import ConnectSettings
from axrl_spike_replay.remote.transport.local_session import LocalSession
from axrl_spike_replay.remote.transport.session import open_session
from axrl_spike_replay.remote.transport.shell import job_script

NASTY = "we ird 'single' \"double\" $(touch PWNED) `touch PWNED2` ; & | $HOME *"


def sleeper_script(marker: str, ready: Path) -> list[str]:
    """A job that starts a child and a grandchild (all tagged with `marker`), says so, then waits."""
    code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}-grandchild"])
        open({str(ready)!r}, "w").write("ready")
        print("started", flush=True)
        time.sleep(600)
        """
    )
    return [sys.executable, "-c", code, f"{marker}-child"]


async def wait_for_file(path: Path, seconds: float = 30.0, text: str = "") -> None:
    """Until `path` exists (and holds `text`)."""
    deadline = time.monotonic() + seconds
    while not path.exists() or text not in path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared (with {text!r})"
        await asyncio.sleep(0.02)


def test_paths_with_shell_metacharacters_reach_the_node_literally(server: LoopbackServer, tmp_path: Path) -> None:
    workdir = tmp_path / NASTY
    workdir.mkdir()
    data = workdir / f"{NASTY}.txt"
    data.write_text("payload")
    code = (
        "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': os.environ['XY']}))"
    )
    script = job_script([sys.executable, "-c", code, str(data), NASTY], cwd=str(workdir), env={"XY": NASTY})

    async def story() -> tuple:
        async with await open_session(server.spec()) as session:
            outcome = await session.run(script, stdout_path=tmp_path / "out.log", stderr_path=tmp_path / "err.log")
            fetched = await session.fetch(str(data), tmp_path / "fetched.txt")
            exists = await session.exists(str(data))
            return outcome, fetched, exists

    outcome, fetched, exists = asyncio.run(story())
    assert outcome.ok, (tmp_path / "err.log").read_text()
    seen = json.loads((tmp_path / "out.log").read_text())
    assert seen == {"argv": [str(data), NASTY], "cwd": str(workdir), "env": NASTY}
    assert fetched.read_text() == "payload" and exists
    assert not list(tmp_path.rglob("PWNED*")) and not (Path.home() / "PWNED").exists()


def test_output_streams_line_by_line_while_the_job_runs(server: LoopbackServer, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    code = textwrap.dedent(
        f"""
        import os, sys, time
        print("first line", flush=True)
        print("warning line", file=sys.stderr, flush=True)
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.01)
        print("last line", flush=True)
        """
    )
    lines: list[tuple[str, str]] = []

    async def story() -> None:
        async with await open_session(server.spec()) as session:
            job = asyncio.ensure_future(
                session.run(
                    job_script([sys.executable, "-c", code]),
                    stdout_path=tmp_path / "stdout.log",
                    stderr_path=tmp_path / "stderr.log",
                    on_line=lambda stream, line: lines.append((stream, line)),
                )
            )
            while "first line\n" not in _read(tmp_path / "stdout.log") or "warning" not in _read(
                tmp_path / "stderr.log"
            ):
                assert not job.done()
                await asyncio.sleep(0.01)
            gate.write_text("go")  # the job is still running: the first lines arrived before it ended
            outcome = await job
            assert outcome.ok

    asyncio.run(story())
    assert _read(tmp_path / "stdout.log") == "first line\nlast line\n"
    assert ("stderr", "warning line") in lines and ("stdout", "last line") in lines


def test_one_connection_runs_a_sweep_of_commands(server: LoopbackServer, tmp_path: Path) -> None:
    async def story() -> list:
        async with await open_session(server.spec()) as session:
            outcomes = []
            for index in range(3):
                out = tmp_path / f"run{index}"
                outcomes.append(
                    await session.run(
                        job_script(["sh", "-c", f"echo config {index}; exit {index}"]),
                        stdout_path=out / "stdout.log",
                        stderr_path=out / "stderr.log",
                    )
                )
            assert not session.connection.client.closed
            return outcomes

    outcomes = asyncio.run(story())
    assert [o.exit_status for o in outcomes] == [0, 1, 2]
    assert [o.ok for o in outcomes] == [True, False, False]
    assert outcomes[2].reason == "exit status 2"
    assert _read(tmp_path / "run1" / "stdout.log") == "config 1\n"


def test_setup_lines_run_first_and_a_failing_one_stops_the_job(server: LoopbackServer, tmp_path: Path) -> None:
    env_file = tmp_path / "env with space.sh"
    env_file.write_text("export AXRL_FROM_SETUP=yes\n")

    async def story() -> tuple:
        async with await open_session(server.spec()) as session:
            good = await session.run(
                job_script(["sh", "-c", "echo $AXRL_FROM_SETUP"], setup=[f". '{env_file}'"]),
                stdout_path=tmp_path / "a.log",
                stderr_path=tmp_path / "a.err",
            )
            bad = await session.run(
                job_script(["sh", "-c", "echo never"], setup=["false"]),
                stdout_path=tmp_path / "b.log",
                stderr_path=tmp_path / "b.err",
            )
            return good, bad

    good, bad = asyncio.run(story())
    assert good.ok and _read(tmp_path / "a.log") == "yes\n"
    assert not bad.ok and "setup line 1 failed: false" in _read(tmp_path / "b.err")
    assert _read(tmp_path / "b.log") == ""


def test_a_cancelled_job_leaves_no_remote_process_and_keeps_partial_logs(
    server: LoopbackServer, tmp_path: Path
) -> None:
    marker = f"axrl-cancel-{secrets.token_hex(6)}"
    ready = tmp_path / "ready"

    async def story() -> None:
        async with await open_session(server.spec()) as session:
            job = asyncio.ensure_future(
                session.run(
                    job_script(sleeper_script(marker, ready)),
                    stdout_path=tmp_path / "stdout.log",
                    stderr_path=tmp_path / "stderr.log",
                )
            )
            await wait_for_file(tmp_path / "stdout.log", text="started")
            assert any(line.endswith(f"{marker}-grandchild") for line in remote_processes(marker))
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job

    asyncio.run(story())
    assert wait_until_gone(marker) == []
    assert "started" in _read(tmp_path / "stdout.log")


def test_an_mcp_style_cancel_scope_still_kills_the_remote_group(server: LoopbackServer, tmp_path: Path) -> None:
    """anyio cancels every await inside a cancelled scope (level cancellation); the kill must still finish."""
    marker = f"axrl-scope-{secrets.token_hex(6)}"
    ready = tmp_path / "ready"

    async def story() -> None:
        async with await open_session(server.spec()) as session:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:

                    async def job() -> None:
                        await session.run(
                            job_script(sleeper_script(marker, ready)),
                            stdout_path=tmp_path / "stdout.log",
                            stderr_path=tmp_path / "stderr.log",
                        )

                    group.start_soon(job)
                    await wait_for_file(tmp_path / "stdout.log", text="started")
                    scope.cancel()
            assert scope.cancelled_caught
            # The connection is still open, so the node-side watchdog has not fired: the kill did it.
            assert not session.connection.client.closed
            assert remote_processes(marker) == []

    anyio.run(story)


def test_a_timeout_kills_the_process_group_and_says_why(server: LoopbackServer, tmp_path: Path) -> None:
    marker = f"axrl-timeout-{secrets.token_hex(6)}"
    ready = tmp_path / "ready"

    async def story():
        async with await open_session(server.spec()) as session:
            return await session.run(
                job_script(sleeper_script(marker, ready)),
                stdout_path=tmp_path / "stdout.log",
                stderr_path=tmp_path / "stderr.log",
                timeout=3.0,
            )

    outcome = asyncio.run(story())
    assert not outcome.ok and "timed out after 3 s" in outcome.reason
    assert wait_until_gone(marker) == []


def test_ctrl_c_kills_the_remote_process_group(server: LoopbackServer, tmp_path: Path) -> None:
    marker = f"axrl-ctrlc-{secrets.token_hex(6)}"
    ready = tmp_path / "ready"
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys
            from pathlib import Path
            from axrl_spike_replay.remote.transport.session import open_session
            from axrl_spike_replay.remote.transport.shell import job_script

            async def main():
                async with await open_session({server.spec()!r}) as session:
                    await session.run(job_script({sleeper_script(marker, ready)!r}),
                                      stdout_path=Path({str(tmp_path / "o.log")!r}),
                                      stderr_path=Path({str(tmp_path / "e.log")!r}))
            try:
                asyncio.run(main())
            except KeyboardInterrupt:
                print("interrupted cleanly")
            """
        )
    )
    process = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=30)
    assert "interrupted cleanly" in out
    assert wait_until_gone(marker) == []


def test_local_session_runs_and_cancels_the_same_way(tmp_path: Path) -> None:
    marker = f"axrl-local-{secrets.token_hex(6)}"
    ready = tmp_path / "ready"

    async def story() -> None:
        session = LocalSession()
        ok = await session.run(
            job_script([sys.executable, "-c", "import sys; print(sys.argv[1])", NASTY], cwd=str(tmp_path)),
            stdout_path=tmp_path / "ok.log",
            stderr_path=tmp_path / "ok.err",
        )
        assert ok.ok and _read(tmp_path / "ok.log") == NASTY + "\n"
        job = asyncio.ensure_future(
            session.run(
                job_script(sleeper_script(marker, ready)), stdout_path=tmp_path / "o", stderr_path=tmp_path / "e"
            )
        )
        await wait_for_file(ready)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(story())
    assert wait_until_gone(marker) == []


@pytest.mark.parametrize("how", ["dropped", "frozen"])
def test_a_lost_connection_fails_cleanly_and_the_node_cleans_up(
    server: LoopbackServer, tmp_path: Path, how: str
) -> None:
    """A dropped connection, or a node that stops answering (keepalives), ends the job as failed with why."""
    marker = f"axrl-lost-{secrets.token_hex(6)}"
    ready = tmp_path / "ready"
    proxy = TcpProxy(server.port)
    settings = ConnectSettings(keepalive_interval=0.5, keepalive_count_max=2)
    spec = server.spec().replace(f"-p {server.port}", f"-p {proxy.port}")
    known = tmp_path / "known_hosts"
    known.write_text(server.known_hosts.read_text().replace(f"]:{server.port} ", f"]:{proxy.port} "))
    spec = spec.replace(str(server.known_hosts), str(known))

    async def story():
        async with await open_session(spec, settings) as session:
            job = asyncio.ensure_future(
                session.run(
                    job_script(sleeper_script(marker, ready)),
                    stdout_path=tmp_path / "stdout.log",
                    stderr_path=tmp_path / "stderr.log",
                )
            )
            await wait_for_file(tmp_path / "stdout.log", text="started")
            proxy.freeze() if how == "frozen" else proxy.drop()
            return await job

    try:
        outcome = asyncio.run(story())
    finally:
        proxy.close()  # a frozen link finally breaks: the node sees its client gone
    assert not outcome.ok and outcome.reason.startswith(f"connection to {spec} lost")
    if how == "frozen":
        assert "keepalive" in outcome.reason
    assert "started" in _read(tmp_path / "stdout.log")
    assert wait_until_gone(marker) == []


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o666])
def test_a_fetched_file_is_no_more_readable_than_on_the_node(server: LoopbackServer, tmp_path: Path, mode: int) -> None:
    data = tmp_path / "node" / "result.json"
    data.parent.mkdir()
    data.write_text("{}")
    data.chmod(mode)

    async def story() -> list[Path]:
        async with await open_session(server.spec()) as session:
            over_ssh = await session.fetch(str(data), tmp_path / "ssh" / "result.json")
        here = await LocalSession().fetch(str(data), tmp_path / "local" / "result.json")
        return [over_ssh, here]

    for fetched in asyncio.run(story()):
        assert fetched.read_text() == "{}"
        assert oct(fetched.stat().st_mode & 0o777) == oct(mode & ~current_umask()), fetched  # the source's, less umask
