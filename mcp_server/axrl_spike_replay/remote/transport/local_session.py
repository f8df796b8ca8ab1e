"""The same session interface on this machine: each job under a reaper (`remote.transport.job_reaper`) in its
own session, so the job and every process it started, `setsid` children included, end with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from axrl_spike_replay.files.atomic import atomic_copy
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.job import (
    KILL_GRACE_S,
    Captured,
    JobOutcome,
    LineCallback,
    check_temp_dir,
    exit_reason,
    pump_lines,
)
from axrl_spike_replay.remote.transport.remote_errors import RemoteError
from axrl_spike_replay.remote.transport.shell import reaper_argv

DRAIN_AFTER_EXIT_S = 5.0  # output still arriving once the job has ended


def _shell() -> str:
    return shutil.which("bash") or "/bin/sh"


class LocalSession:
    """Runs jobs here, as `RemoteSession` does on a node (used when no target is given)."""

    label = "local"

    async def __aenter__(self) -> LocalSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(
        self,
        script: str,
        *,
        stdout_path: Path,
        stderr_path: Path,
        timeout: float | None = None,
        on_line: LineCallback | None = None,
    ) -> JobOutcome:
        """Run `script` under the job reaper in a new session; on timeout or cancel stop the job and everything it
        started, keep partial logs. When the script ends, processes it left running are stopped too."""
        started = time.monotonic()
        stdout_path.parent.mkdir(parents=True, exist_ok=True)
        stderr_path.parent.mkdir(parents=True, exist_ok=True)
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            try:
                process = await asyncio.create_subprocess_exec(
                    *reaper_argv(sys.executable, _shell(), script, watch=True),
                    stdin=asyncio.subprocess.PIPE,  # never written: its EOF tells the reaper we are gone
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as exc:
                return JobOutcome(False, None, f"cannot start the command: {exc}", stdout_path, stderr_path, 0.0)
            pumps = [
                asyncio.ensure_future(pump_lines(process.stdout, out, "stdout", on_line)),
                asyncio.ensure_future(pump_lines(process.stderr, err, "stderr", on_line)),
            ]
            finished = asyncio.ensure_future(_finish(process, pumps))
            try:
                await asyncio.wait_for(asyncio.shield(finished), timeout)
            except asyncio.TimeoutError:
                await run_to_completion(_stop(process, finished))
                reason = f"timed out after {timeout:g} s; the command and every process it started were killed"
                return JobOutcome(False, process.returncode, reason, stdout_path, stderr_path, _since(started))
            except asyncio.CancelledError:
                await run_to_completion(_stop(process, finished))
                raise
            finally:
                _close_stdin(process)
        code = process.returncode
        reason = exit_reason(code) if code is None or code >= 0 else f"killed by signal {-code}"
        return JobOutcome(reason is None, code, reason, stdout_path, stderr_path, _since(started))

    async def capture(self, script: str, *, timeout: float = 60.0) -> Captured:
        """Run a short shell script here and return its output."""
        process = await asyncio.create_subprocess_exec(
            _shell(),
            "-c",
            script,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            _killpg(process.pid, signal.SIGKILL)
            await process.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise RemoteError(f"local command did not finish within {timeout:g} s: {script[:200]}") from None
        return Captured(process.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    async def fetch(self, path: str, local_path: Path, max_bytes: int | None = None) -> Path:
        """Copy `path` to `local_path` atomically (nothing to do when they are the same file); the copy is no more
        readable than `path`."""
        source = Path(path)
        if not source.is_file():
            raise RemoteError(f"{path} does not exist" if not source.exists() else f"{path} is not a regular file")
        if max_bytes is not None and (size := source.stat().st_size) > max_bytes:
            raise RemoteError(f"{path} is {size} bytes, more than the {max_bytes}-byte limit")
        if local_path.exists() and source.resolve() == local_path.resolve():
            return local_path
        local_path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_copy(source, local_path)

    async def put(self, local_path: Path, path: str) -> None:
        """Copy a file (same machine); the copy is no more readable than `local_path`."""
        atomic_copy(local_path, path)

    async def exists(self, path: str) -> bool:
        return Path(path).exists()

    async def make_temp_dir(self, prefix: str = "axrl-") -> str:
        """A new private temp directory."""
        return tempfile.mkdtemp(prefix=prefix)

    async def remove_temp_dir(self, path: str) -> None:
        """Remove a directory made by `make_temp_dir`."""
        shutil.rmtree(check_temp_dir(path), ignore_errors=True)

    async def close(self) -> None:
        return None


async def _finish(process: asyncio.subprocess.Process, pumps: Sequence[asyncio.Future[None]]) -> None:
    """The job's end: the reaper's exit, then its output drained. The reaper takes the job's processes with it,
    so the pipes close; a process outside its reach holding them (none is known) is waited on for a bounded time."""
    await process.wait()
    _done, pending = await asyncio.wait(pumps, timeout=DRAIN_AFTER_EXIT_S)
    for pump in pending:
        pump.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)


def _close_stdin(process: asyncio.subprocess.Process) -> None:
    if process.stdin is not None:
        with contextlib.suppress(Exception):
            process.stdin.close()


async def _stop(process: asyncio.subprocess.Process, finished: asyncio.Future) -> None:
    """TERM the process group, KILL it after a grace period, then let the output drain."""
    _killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(finished), KILL_GRACE_S)
    _killpg(process.pid, signal.SIGKILL)  # the group may outlive its leader
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(finished, KILL_GRACE_S)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
