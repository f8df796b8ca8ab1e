"""A session on a node over SSH: one connection reused for many jobs, killable process groups, SFTP transfers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

from axrl_spike_replay.files.atomic import copy_mode, temp_beside
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.connect import ConnectSettings, SshConnection, open_connection
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
from axrl_spike_replay.remote.transport.shell import detached_command, kill_group_command, parse_pgid_marker
from axrl_spike_replay.remote.transport.ssh_library import FILEXFER_TYPE_DIRECTORY, FILEXFER_TYPE_REGULAR, asyncssh
from axrl_spike_replay.remote.transport.target import SshTarget, parse_target

DRAIN_AFTER_KILL_S = 10.0


class RemoteSession:
    """Jobs, short commands and file transfers on one SSH connection."""

    def __init__(self, connection: SshConnection) -> None:
        self._connection = connection
        self._sftp: asyncssh.SFTPClient | None = None
        self.label = connection.label

    @property
    def connection(self) -> SshConnection:
        return self._connection

    async def __aenter__(self) -> RemoteSession:
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
        """Run `script` under setsid on the node; on timeout or cancel kill its process group, keep partial logs."""
        pgid: list[int] = []

        def announce(line: bytes) -> bool:
            if pgid:
                return False
            found = parse_pgid_marker(line)
            if found is not None:
                pgid.append(found)
            return found is not None

        started = time.monotonic()
        stdout_path.parent.mkdir(parents=True, exist_ok=True)
        stderr_path.parent.mkdir(parents=True, exist_ok=True)
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            try:
                process = await self._connection.conn.create_process(detached_command(script), encoding=None)
            except (asyncssh.Error, OSError) as exc:
                reason = self._lost_or(f"cannot start the command: {exc}")
                return JobOutcome(False, None, reason, stdout_path, stderr_path, time.monotonic() - started)
            pumps = [
                asyncio.ensure_future(pump_lines(process.stdout, out, "stdout", on_line)),
                asyncio.ensure_future(pump_lines(process.stderr, err, "stderr", on_line, announce)),
            ]
            finished = asyncio.ensure_future(self._finish(process, pumps))
            try:
                await asyncio.wait_for(asyncio.shield(finished), timeout)
            except asyncio.TimeoutError:
                await run_to_completion(self._stop(pgid[0] if pgid else None, process, finished))
                reason = f"timed out after {timeout:g} s; the remote process group was killed"
                return JobOutcome(False, process.exit_status, reason, stdout_path, stderr_path, _since(started))
            except asyncio.CancelledError:
                await run_to_completion(self._stop(pgid[0] if pgid else None, process, finished))
                raise
            finally:
                process.close()
        lost = self._connection.lost_reason
        if lost is not None and process.exit_status is None:
            reason = f"connection to {self.label} lost while the command ran: {lost}"
            return JobOutcome(False, None, reason, stdout_path, stderr_path, _since(started))
        signal = process.exit_signal[0] if process.exit_signal else None
        reason = exit_reason(process.exit_status, signal)
        return JobOutcome(reason is None, process.exit_status, reason, stdout_path, stderr_path, _since(started))

    async def _finish(self, process: asyncssh.SSHClientProcess, pumps: Sequence[asyncio.Future[None]]) -> None:
        await asyncio.gather(*pumps, return_exceptions=True)
        await process.wait_closed()

    async def _stop(self, pgid: int | None, process: asyncssh.SSHClientProcess, finished: asyncio.Future) -> None:
        """Kill the job's process group over a second channel, then let the output drain.

        Before the group id was announced, closing the channel is all there is to do: the node's watchdog
        kills the group when the channel's stdin closes.
        """
        with contextlib.suppress(Exception, asyncio.CancelledError):
            if self._connection.lost_reason is None and pgid is not None:
                await asyncio.wait_for(
                    self._connection.conn.run(kill_group_command(pgid, KILL_GRACE_S), check=False),
                    KILL_GRACE_S + 10.0,
                )
        process.close()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(finished, DRAIN_AFTER_KILL_S)
        if not finished.done():
            finished.cancel()

    async def capture(self, script: str, *, timeout: float = 60.0) -> Captured:
        """Run a short shell script (no process group handling) and return its output."""
        try:
            result = await asyncio.wait_for(self._connection.conn.run(script, check=False), timeout)
        except asyncio.TimeoutError:
            raise RemoteError(f"{self.label}: command did not finish within {timeout:g} s: {script[:200]}") from None
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(self._lost_or(f"{self.label}: command failed to run: {exc}")) from None
        return Captured(result.exit_status, _text(result.stdout), _text(result.stderr))

    async def sftp(self) -> asyncssh.SFTPClient:
        """The session's SFTP client (started on first use)."""
        if self._sftp is None:
            try:
                self._sftp = await self._connection.conn.start_sftp_client()
            except (asyncssh.Error, OSError) as exc:
                raise RemoteError(f"{self.label}: cannot start SFTP: {exc}") from None
        return self._sftp

    async def fetch(self, path: str, local_path: Path, max_bytes: int | None = None) -> Path:
        """Copy node file `path` to `local_path` over SFTP, atomically (temp file, then rename); the copy is no
        more readable than the node's file (its mode less the local umask). RemoteError when it is not a regular
        file or is larger than `max_bytes`."""
        sftp = await self.sftp()
        attrs = await self._stat(sftp, path)
        if max_bytes is not None:
            if attrs.type != FILEXFER_TYPE_REGULAR:
                raise RemoteError(f"{self.label}: {path} is not a regular file")
            if attrs.size is not None and attrs.size > max_bytes:
                raise RemoteError(f"{self.label}: {path} is {attrs.size} bytes, more than the {max_bytes}-byte limit")
        local_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_beside(local_path, suffix=".part", mode=0o600, sweep=True)
        # a server that does not say keeps the copy private; a group is the node's where the ids match (a cluster's
        # shared group database), else the copy's group bits fall to what the node's file gives others
        same_group = attrs.gid is not None and attrs.gid == os.fstat(fd).st_gid
        os.fchmod(fd, copy_mode(attrs.permissions if attrs.permissions else 0o600, same_group=same_group))
        try:
            await sftp.get(path, tmp)  # our descriptor keeps the temp locked until it is renamed
            os.replace(tmp, local_path)
        except asyncssh.SFTPNoSuchFile:
            raise RemoteError(f"{self.label}: {path} does not exist on the node") from None
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(self._lost_or(f"{self.label}: cannot fetch {path}: {exc}")) from None
        finally:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
        return local_path

    async def _stat(self, sftp: asyncssh.SFTPClient, path: str) -> asyncssh.SFTPAttrs:
        try:
            return await sftp.stat(path)
        except asyncssh.SFTPNoSuchFile:
            raise RemoteError(f"{self.label}: {path} does not exist on the node") from None
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(self._lost_or(f"{self.label}: cannot fetch {path}: {exc}")) from None

    async def fetch_tree(self, path: str, local_dir: Path, skip: tuple[str, ...] = ()) -> list[Path]:
        """Copy every regular file under node dir `path` into `local_dir` (same relative paths); the local files."""
        sftp = await self.sftp()
        fetched: list[Path] = []
        try:
            entries = await sftp.readdir(path)
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(self._lost_or(f"{self.label}: cannot list {path}: {exc}")) from None
        for entry in sorted(entries, key=lambda e: str(e.filename)):
            name = str(entry.filename)
            if name in (".", "..") or name in skip:
                continue
            kind = entry.attrs.type
            if kind == FILEXFER_TYPE_DIRECTORY:
                fetched += await self.fetch_tree(f"{path}/{name}", local_dir / name, skip)
            elif kind == FILEXFER_TYPE_REGULAR:
                fetched.append(await self.fetch(f"{path}/{name}", local_dir / name))
        return fetched

    async def glob(self, pattern: str) -> list[str]:
        """Node paths matching a glob pattern (SFTP; no shell involved)."""
        sftp = await self.sftp()
        try:
            return sorted(str(p) for p in await sftp.glob(pattern))
        except asyncssh.SFTPNoSuchFile:
            return []
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(self._lost_or(f"{self.label}: cannot list {pattern}: {exc}")) from None

    async def put(self, local_path: Path, path: str) -> None:
        """Copy `local_path` to node path `path` over SFTP."""
        sftp = await self.sftp()
        try:
            await sftp.put(str(local_path), path)
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(self._lost_or(f"{self.label}: cannot copy {local_path} to {path}: {exc}")) from None

    async def exists(self, path: str) -> bool:
        """Whether `path` exists on the node."""
        sftp = await self.sftp()
        try:
            return await sftp.exists(path)
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(self._lost_or(f"{self.label}: cannot check {path}: {exc}")) from None

    async def make_temp_dir(self, prefix: str = "axrl-") -> str:
        """A new private directory under the node's temp dir."""
        if not prefix.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"temp dir prefix {prefix!r} must be letters, digits, '-' or '_'")
        got = await self.capture(f'mktemp -d "${{TMPDIR:-/tmp}}/{prefix}XXXXXXXX"')
        if got.exit_status != 0 or not got.stdout.strip():
            raise RemoteError(f"{self.label}: cannot create a temp directory: {got.stderr.strip()}")
        return got.stdout.strip()

    async def remove_temp_dir(self, path: str) -> None:
        """Remove a directory made by `make_temp_dir` (over SFTP: no shell, no extra session)."""
        sftp = await self.sftp()
        try:
            await sftp.rmtree(check_temp_dir(path), ignore_errors=True)
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(self._lost_or(f"{self.label}: cannot remove {path}: {exc}")) from None

    async def close(self) -> None:
        """Close SFTP and the connection (and its jump hosts)."""
        if self._sftp is not None:
            self._sftp.exit()
            self._sftp = None
        with contextlib.suppress(Exception):
            await self._connection.close()

    def _lost_or(self, message: str) -> str:
        lost = self._connection.lost_reason
        return f"connection to {self.label} lost: {lost}" if lost else message


async def open_session(target: SshTarget | str, settings: ConnectSettings | None = None) -> RemoteSession:
    """Connect to `target` (an SshTarget or any target text) and return a session on it."""
    if isinstance(target, str):
        target = parse_target(target)
    return RemoteSession(await open_connection(target, settings))


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)


def _text(data: object) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
