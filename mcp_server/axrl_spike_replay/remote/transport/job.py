"""What running one job gives back, the interface local and SSH sessions share, and line-by-line log streaming."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

LineCallback = Callable[[str, str], None]  # (stream "stdout"|"stderr", line without newline)
KILL_GRACE_S = 5.0  # a stopped job's process group: SIGTERM, then SIGKILL after this long (local and SSH alike)
_CHUNK = 1 << 16
MAX_LINE_BYTES = 64 << 10  # a longer output line is cut here, with TRUNCATED_MARK
TRUNCATED_MARK = b" ... [%d more bytes of this line dropped]"


class ChunkReader(Protocol):
    """A process's output stream: asyncio's StreamReader (bytes) or asyncssh's SSHReader (bytes or str)."""

    async def read(self, n: int = -1, /) -> bytes | str: ...


@dataclass
class JobOutcome:
    """How a job ended. `reason` says why when `ok` is False (exit status, timeout, cancel, connection lost)."""

    ok: bool
    exit_status: int | None
    reason: str | None
    stdout_path: Path
    stderr_path: Path
    seconds: float


@dataclass
class Captured:
    """A short command's exit status and output."""

    exit_status: int | None
    stdout: str
    stderr: str


class Session(Protocol):
    """Where jobs run: this machine (`LocalSession`) or a node over SSH (`RemoteSession`)."""

    label: str  # "local" or the SSH target as given

    async def run(
        self,
        script: str,
        *,
        stdout_path: Path,
        stderr_path: Path,
        timeout: float | None = None,
        on_line: LineCallback | None = None,
    ) -> JobOutcome:
        """Run a shell script in its own process group, streaming its output into the two files."""
        ...

    async def capture(self, script: str, *, timeout: float = 60.0) -> Captured:
        """Run a short shell script and return its output."""
        ...

    async def fetch(self, path: str, local_path: Path, max_bytes: int | None = None) -> Path:
        """Copy a file of the session's machine to `local_path` (atomically); RemoteError when it is not a regular
        file or is larger than `max_bytes` (checked before copying)."""
        ...

    async def put(self, local_path: Path, path: str) -> None:
        """Copy a local file to `path` on the session's machine."""
        ...

    async def exists(self, path: str) -> bool:
        """Whether `path` exists on the session's machine."""
        ...

    async def make_temp_dir(self, prefix: str = "axrl-") -> str:
        """A new private directory under the machine's temp dir."""
        ...

    async def remove_temp_dir(self, path: str) -> None:
        """Remove a directory made by `make_temp_dir` (and nothing else)."""
        ...

    async def close(self) -> None:
        """Release the connection, if any."""
        ...


async def pump_lines(
    reader: ChunkReader | None,
    sink: BinaryIO,
    stream: str,
    on_line: LineCallback | None,
    intercept: Callable[[bytes], bool] | None = None,
) -> None:
    """Copy `reader` into `sink` line by line (flushed after each line) until EOF; a last partial line too.

    A line for which `intercept` returns True is consumed (not written, not reported). A line longer than
    `MAX_LINE_BYTES` keeps its first `MAX_LINE_BYTES` and ends with a marker saying how much was dropped:
    a command printing a 100 MB line costs linear time and bounded memory, and is never echoed whole.
    """
    if reader is None:  # a stream that was not piped: nothing to copy
        return
    line = _LineBuffer()

    def emit() -> None:
        text = line.take()
        if intercept is not None and intercept(text):
            return
        sink.write(text + b"\n")
        sink.flush()
        if on_line is not None:
            on_line(stream, text.decode("utf-8", "replace"))

    while True:
        chunk = await reader.read(_CHUNK)
        if not chunk:
            break
        if isinstance(chunk, str):
            chunk = chunk.encode("utf-8", "replace")
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line.add(chunk, start, end)
            emit()
            start = end + 1
        line.add(chunk, start, len(chunk))
    if line.size or line.dropped:
        text = line.take()
        sink.write(text)
        sink.flush()
        if on_line is not None:
            on_line(stream, text.decode("utf-8", "replace"))


class _LineBuffer:
    """The line being read: at most `MAX_LINE_BYTES` kept, the rest counted."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.dropped = 0

    def add(self, chunk: bytes, start: int, end: int) -> None:
        keep = min(end - start, MAX_LINE_BYTES - self.size)
        if keep > 0:
            self.parts.append(chunk[start : start + keep])
            self.size += keep
        self.dropped += end - start - max(keep, 0)

    def take(self) -> bytes:
        text = b"".join(self.parts)
        if self.dropped:
            text += TRUNCATED_MARK % self.dropped
        self.parts, self.size, self.dropped = [], 0, 0
        return text


def check_temp_dir(path: str) -> str:
    """`path` if it looks like a directory `make_temp_dir` made (`.../axrl-*`); refuses anything else."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if not name.startswith("axrl-") or len(name) < 9 or "/" not in path:
        raise ValueError(f"refusing to remove {path!r}: not a temp dir made by this tool")
    return path


def exit_reason(exit_status: int | None, signal_name: str | None = None) -> str | None:
    """Why a finished job counts as failed, or None for exit status 0."""
    if signal_name:
        return f"killed by signal {signal_name}"
    if exit_status is None:
        return "ended without an exit status"
    if exit_status == 0:
        return None
    if exit_status > 128:
        return f"exit status {exit_status} (signal {exit_status - 128})"
    return f"exit status {exit_status}"
