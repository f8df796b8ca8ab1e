"""Shell text for remote commands: every argument quoted; jobs run in their own process group so they can be killed."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from axrl_spike_replay.errors import ConfigError

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: `$` lets "\n" through
SETUP_FAILED_STATUS = 97
CWD_FAILED_STATUS = 96


def quote_argv(argv: Sequence[str]) -> str:
    """`argv` as one shell command line, each word quoted so the shell passes it through literally."""
    if not argv:
        raise ConfigError("empty command")
    return " ".join(shlex.quote(str(word)) for word in argv)


def job_script(
    argv: Sequence[str] | str,
    *,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    setup: Sequence[str] = (),
) -> str:
    """A shell script: setup lines (verbatim, each must succeed), `cd` to `cwd`, exports, then `exec argv`.

    `argv` as a string is a shell command line that is run as written (its own words must already be quoted).
    """
    lines: list[str] = []
    for number, line in enumerate(setup, 1):
        if "\n" in line:
            raise ConfigError(f"setup line {number} spans several lines; give one shell line per entry")
        lines.append(line)
        message = shlex.quote(f"setup line {number} failed: {line}")
        lines.append(f'_axrl_rc=$?; [ "$_axrl_rc" -eq 0 ] || {{ echo {message} >&2; exit {SETUP_FAILED_STATUS}; }}')
    if cwd:
        lines.append(f"cd -- {shlex.quote(cwd)} || exit {CWD_FAILED_STATUS}")
    for name, value in (env or {}).items():
        if not _ENV_NAME_RE.fullmatch(name):
            raise ConfigError(f"environment variable name {name!r} is not a valid shell name")
        lines.append(f"export {name}={shlex.quote(str(value))}")
    lines.append(argv if isinstance(argv, str) else f"exec {quote_argv(argv)}")
    return "\n".join(lines) + "\n"


def bash_command(script: str) -> str:
    """A command line that runs `script` with bash where the node has it (setup lines often need it), else sh."""
    chooser = 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1" axrl; else exec sh -c "$1" axrl; fi'
    return f"sh -c {shlex.quote(chooser)} axrl-wrap {shlex.quote(script)}"


PGID_MARKER = b"@@axrl-pgid "


def parse_pgid_marker(line: bytes) -> int | None:
    """The process-group id announced by `detached_command` on stderr, when `line` is that announcement."""
    if not line.startswith(PGID_MARKER):
        return None
    text = line[len(PGID_MARKER) :].strip()
    return int(text) if text.isdigit() else None


def reaper_source() -> str:
    """The text of `remote.transport.job_reaper`, run as `python3 -c` (a node need not have this package)."""
    from axrl_spike_replay.remote.transport import job_reaper

    return Path(job_reaper.__file__).read_text(encoding="utf-8")


def reaper_argv(python: str, shell: str, script: str, *, watch: bool = False) -> list[str]:
    """The argv that runs `script` with `shell` under the job reaper (`watch`: also stop when stdin closes)."""
    return [python, "-I", "-S", "-c", reaper_source(), shell, script, *(["watch"] if watch else [])]


def detached_command(script: str) -> str:
    """The command line sent to sshd: run `script` under `setsid` (own session and process group), under the
    job reaper (`remote.transport.job_reaper`) when the node has `python3`, so processes that leave the group are
    stopped too; a node without python3 gets the group alone.

    The job's process-group id is announced as the line `@@axrl-pgid <id>` on stderr (the client keeps it
    out of the log), so a second channel can kill the whole group (sshd ignores signal requests for root
    sessions before OpenSSH 9.8); the reaper, in that group, stops the rest. A watchdog kills the group when
    the channel's stdin closes, i.e. when the client went away without cleaning up.
    """
    wrapper = (
        "if command -v bash >/dev/null 2>&1; then _sh=bash; else _sh=sh; fi\n"
        # A background list gets /dev/null as stdin unless redirected explicitly: keep the channel's as fd 3.
        "exec 3<&0\n"
        # Backgrounded by a non-interactive shell, the child is no group leader, so setsid does not fork:
        # its pid is the new session's and group's id.
        "if command -v python3 >/dev/null 2>&1; then\n"
        '  setsid python3 -I -S -c "$2" "$_sh" "$1" </dev/null 3<&- &\n'
        "else\n"
        '  setsid "$_sh" -c "$1" axrl-job </dev/null 3<&- &\n'
        "fi\n"
        "_pid=$!\n"
        f'echo "{PGID_MARKER.decode()}$_pid" >&2\n'
        '( cat <&3 >/dev/null 2>&1; kill -TERM -"$_pid" ) >/dev/null 2>&1 &\n'
        "_watch=$!\n"
        "exec 3<&-\n"
        'wait "$_pid"; _rc=$?\n'
        'kill "$_watch" 2>/dev/null\n'
        'exit "$_rc"\n'
    )
    return f"sh -c {shlex.quote(wrapper)} axrl-wrap {shlex.quote(script)} {shlex.quote(reaper_source())}"


def kill_group_command(pgid: int, grace_s: float = 5.0) -> str:
    """Shell text that sends TERM to process group `pgid`, waits up to `grace_s` for it to end, then KILL."""
    if not isinstance(pgid, int) or pgid <= 1:
        raise ValueError(f"refusing to signal process group {pgid!r}")
    steps = max(1, int(grace_s * 10))
    script = (
        f"kill -TERM -{pgid} 2>/dev/null || exit 0\n"
        "_i=0\n"
        f"while kill -0 -{pgid} 2>/dev/null; do\n"
        f'  _i=$((_i + 1)); if [ "$_i" -ge {steps} ]; then kill -KILL -{pgid} 2>/dev/null; break; fi\n'
        "  sleep 0.1\n"
        "done\n"
    )
    return f"sh -c {shlex.quote(script)}"
