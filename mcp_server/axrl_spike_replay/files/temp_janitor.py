"""Private temp dirs that go away when the process that made them dies, however it dies (SIGKILL too).

A small watcher process (one per owner process, started on first use) holds the read end of a
pipe; the owner writes each temp dir it makes and each one it has removed. When the owner dies the
kernel closes the write end, the watcher reads EOF and removes every dir still listed. A normal
exit removes the dirs in the owner, as `tempfile.TemporaryDirectory` would.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

log = logging.getLogger("axrl_spike_replay.files.temp_janitor")
_lock = threading.Lock()
_owned: set[str] = set()
_watcher: subprocess.Popen[str] | None = None
_watcher_owner = 0  # the pid that started `_watcher` (a forked child must not share it)


@contextmanager
def owned_temp_dir(prefix: str) -> Iterator[str]:
    """A private temp dir (mode 0700), removed on exit and by the watcher if this process dies first."""
    path = tempfile.mkdtemp(prefix=prefix)
    _tell("+", path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        _tell("-", path)


@contextmanager
def removed_if_killed(path: str) -> Iterator[str]:
    """Hand the watcher a temp dir made elsewhere: removed if this process dies inside the block.

    The caller still removes it on a normal exit; the watcher forgets it when the block ends.
    """
    _tell("+", path)
    try:
        yield path
    finally:
        _tell("-", path)


def _tell(op: str, path: str) -> None:
    with _lock:
        if op == "+":
            _owned.add(path)
        else:
            _owned.discard(path)
        pipe = _watcher_pipe()
        if pipe is None:
            return
        try:
            pipe.write(json.dumps([op, path]) + "\n")
            pipe.flush()
        except (OSError, ValueError):  # the watcher went away: the next registration starts another
            _forget_watcher()


def _watcher_pipe() -> IO[str] | None:
    global _watcher, _watcher_owner
    if _watcher is not None and (_watcher_owner != os.getpid() or _watcher.poll() is not None):
        _forget_watcher()
    if _watcher is None and _owned:
        package_root = str(Path(__file__).resolve().parents[2])
        code = (
            f"import sys; sys.path.insert(0, {package_root!r}); "
            "from axrl_spike_replay.files.temp_janitor import watch; watch()"
        )
        try:
            _watcher = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,  # stdout may be an MCP stdio channel or a --json document
                text=True,
                start_new_session=True,  # a Ctrl-C or SIGTERM to our process group must not stop it first
            )
        except OSError as exc:
            log.warning("cannot start the temp-dir watcher (%s); temp dirs may be left if this process is killed", exc)
            return None
        _watcher_owner = os.getpid()
        assert _watcher.stdin is not None
        for path in sorted(_owned):
            _watcher.stdin.write(json.dumps(["+", path]) + "\n")
    return None if _watcher is None else _watcher.stdin


def _forget_watcher() -> None:
    global _watcher
    if _watcher is not None and _watcher_owner == os.getpid():
        try:
            if _watcher.stdin is not None:
                _watcher.stdin.close()
        except OSError:
            pass
    _watcher = None


def watch(stream: IO[str] | None = None) -> None:
    """The watcher's loop: read `["+"|"-", path]` lines until EOF, then remove the dirs still listed."""
    listed: set[str] = set()
    for line in stream or sys.stdin:
        try:
            op, path = json.loads(line)
        except ValueError:
            continue
        if op == "+":
            listed.add(path)
        else:
            listed.discard(path)
    for path in listed:
        shutil.rmtree(path, ignore_errors=True)
