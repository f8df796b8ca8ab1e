"""Run a job's shell script and take every process it started with it, `setsid` children included (Linux).

A process group is not enough to stop a job: a child that calls `setsid` (a daemonising helper, a
`nohup`-style wrapper, a data loader that detaches) leaves the group, and a child that outlives the
command while holding its stdout keeps the output pipe (and an SSH channel) open for as long as it
lives. This reaper closes both holes without privileges:

- it makes itself a *child subreaper* (`prctl(PR_SET_CHILD_SUBREAPER)`): a descendant whose parent
  dies is re-parented to the reaper instead of to init, whatever session or group it moved to;
- so every live process the job started is a descendant of the reaper in `/proc`'s parent links.
  When the script ends (or the reaper is told to stop: SIGTERM/SIGINT/SIGHUP, or its stdin closing
  in `watch` mode), it sends SIGTERM to every descendant, SIGKILL to what is left after a grace
  period, and reaps them all before it exits with the script's status (128 + N for signal N).

cgroups would give the same guarantee but need a delegated hierarchy (systemd-run --user, root),
which a shared GPU node rarely offers to a login shell; a subreaper needs nothing.

The file is self-contained (standard library only, Python 3.6+ syntax): it is sent as the text of
`python3 -c` to nodes, which need not have this package installed. Usage:
`python3 -I -S -c "$(cat job_reaper.py)" SHELL SCRIPT [watch]`.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 2.0  # TERM -> KILL; kept well under the callers' own grace, which end with a KILL of the group
GIVE_UP_S = 10.0  # a process stuck in the kernel (D state) cannot be killed: stop trying after this


class _Stop(Exception):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, _frame):
    raise _Stop(signum)


def _become_subreaper():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _descendants(root):
    """Live (non-zombie) descendants of `root`, from the parent links in /proc; [] without /proc."""
    children = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 2 or fields[0] == b"Z":
            continue  # a zombie is dead already (and has no children left)
        children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _signal_all(pids, signum):
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


def _reap():
    """Collect every exited child (orphans re-parented to us included) without blocking."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_tree(grace_s=GRACE_S):
    """TERM every descendant of this process, KILL those left after `grace_s`, reap them; how many there were."""
    me = os.getpid()
    first = _descendants(me)
    if not first:
        _reap()
        return 0
    _signal_all(first, signal.SIGTERM)
    started = time.monotonic()
    while True:
        _reap()
        left = _descendants(me)
        waited = time.monotonic() - started
        if not left or waited > grace_s + GIVE_UP_S:
            return len(first)
        if waited >= grace_s:
            _signal_all(left, signal.SIGKILL)  # again each round: a dying parent may hand us new orphans
        time.sleep(0.02)


def _exit_code(status):
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 1


def _watch_stdin():
    """Stop the job when stdin reaches EOF: the caller (an SSH channel, a local parent) went away."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv):
    """Run `argv[2]` with shell `argv[1]` under this reaper; `argv[3] == "watch"` also stops on stdin EOF."""
    shell, script = argv[1], argv[2]
    watch = len(argv) > 3 and argv[3] == "watch"
    _become_subreaper()  # without it (not Linux), the callers' kill of the process group is what is left
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    code, stopped_by = 1, 0
    try:
        try:
            child = subprocess.Popen([shell, "-c", script, "axrl-job"], stdin=subprocess.DEVNULL)
        except OSError as exc:
            sys.stderr.write(f"axrl: cannot start {shell}: {exc}\n")
            return 127
        if watch:
            threading.Thread(target=_watch_stdin, daemon=True).start()
        while True:
            pid, status = os.wait()  # orphans re-parented to us are collected here too
            if pid == child.pid:
                child.returncode = code = _exit_code(status)
                break
    except _Stop as stop:
        code = stopped_by = 128 + stop.signum
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # the clean-up below must finish; a KILL still ends it
    left = stop_tree()
    if left and stopped_by:
        sys.stderr.write(f"axrl: the job was stopped (signal {stopped_by - 128}): {left} process(es) ended\n")
    elif left:
        sys.stderr.write(f"axrl: stopped {left} process(es) the command left running\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
