"""Where rank processes come from: forked from a server that has imported torch and this package once.

Starting a process with `spawn` starts Python and imports torch again: seconds per process on a small machine,
paid by every multi-process replay, capture and warm pool. Here the first start launches multiprocessing's
forkserver, which imports torch, torch.distributed and the modules the rank functions use (`PRELOAD`), and
then only forks. It runs no torch op and no thread: it starts with one OpenMP thread (importing torch with more
starts a thread), so a process forked from it begins with fresh torch state (no intra-op pool, no process group,
no CUDA context) and a gloo group made there is its own. Later starts take milliseconds. `warm_up` launches the
server ahead of need, so its imports overlap the caller's own work.

A model kind's libraries (transformers for `hf`, megatron-core and transformers for `megatron`: seconds of
imports) are imported by the server too when asked before it starts: per job by the launcher, which knows the
snapshot (`warm_up(kinds)`, `preload_for`), or for every job of a process by AXRL_PRELOAD (`hf,megatron`). Those
imports start no thread either (the tests check the server's threads); a package that is not installed is skipped,
and its rank processes fail on it as they would without the preload. As for torch, variables those libraries read
when imported are the server's. A server already running keeps what it imported: it is not restarted (the warm
pool's processes die with it), and its ranks import the rest themselves.

A forked process's parent is the server, not the launcher. `die_with_launcher` (first thing in each process
started here) ties it to both: the kernel kills it when the server exits (PR_SET_PDEATHSIG); it closes its copy
of the server's "alive" pipe, so the server (which exits when every holder of that pipe is gone) ends as soon
as the launcher does; and a watchdog thread ends it when the launcher's end of its own pipe closes. A launcher
killed with SIGKILL takes the server and every process with it.

The environment a process sees is the launcher's at the start (`launcher_environment`, applied by
`adopt_environment`), not the server's, as under `spawn`. Variables read while torch is imported are the
server's: the launcher's when the server started. Its standard output and error are the launcher's at the start
too (`LauncherStreams`, applied by `adopt_streams`): a launcher that redirected them after the server started
(a test capturing them, a service writing a log) sees what its processes print.

Fallback: `spawn` where the forkserver is missing (not POSIX) or failed to start, or when
AXRL_START_METHOD=spawn asks for it (each start reads it).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import warnings
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

from axrl_spike_replay.errors import AxrlError

log = logging.getLogger("axrl_spike_replay.processes.process_starts")
START_METHOD_ENV = "AXRL_START_METHOD"
START_METHODS = ("forkserver", "spawn")
# Imported once by the server: torch, its process groups and checkpoint reader, and what the rank functions of
# replays, captures and the warm pool import. Names, not imports: the server imports them, this process need not.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.multiprocessing",
    "axrl_spike_replay.processes.rank_processes",
    "axrl_spike_replay.replay.compute.worker",
    "axrl_spike_replay.replay.jobs.job_runner",
    "axrl_spike_replay.replay.jobs.warm_pool",
    "axrl_spike_replay.capture.reference.reference_trainer",
)
PRELOAD_ENV = "AXRL_PRELOAD"
# What rank processes of a model kind import beyond PRELOAD (modules that import what is installed of it).
KIND_PRELOADS: dict[str, tuple[str, ...]] = {
    "hf": ("axrl_spike_replay.models.hf_preload",),
    "megatron": ("axrl_spike_replay.models.hf_preload", "axrl_spike_replay.models.mcore.megatron_preload"),
}
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_SERVER_ENV = {"OMP_NUM_THREADS": "1"}  # the server's own: importing torch starts no OpenMP thread there
_lock = threading.Lock()
_server_failed: list[str] = []  # why the server could not start, once: later starts spawn without trying again
_asked_kinds: set[str] = set()  # model kinds whose libraries the server imports when it starts (`preload_for`)


def start_method() -> str:
    """`forkserver` (the default where it exists and has not failed here) or `spawn`; AXRL_START_METHOD overrides."""
    asked = os.environ.get(START_METHOD_ENV, "").strip().lower()
    if asked and asked not in START_METHODS:
        raise AxrlError(f"{START_METHOD_ENV}={asked!r}: expected one of {', '.join(START_METHODS)}")
    if asked == "spawn" or _server_failed or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return "forkserver"


def rank_context() -> ForkServerContext | SpawnContext:
    """The multiprocessing context that starts rank processes: the forkserver's (launched here on first use),
    or `spawn` where it is unavailable. Make queues, events and pipes for those processes from it too."""
    if start_method() == "forkserver" and _ensure_server():
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


def preload_kinds() -> tuple[str, ...]:
    """The model kinds named by AXRL_PRELOAD (comma-separated, e.g. `hf,megatron`); an unknown one is refused."""
    named = [kind.strip().lower() for kind in os.environ.get(PRELOAD_ENV, "").split(",") if kind.strip()]
    unknown = [kind for kind in named if kind not in KIND_PRELOADS]
    if unknown:
        raise AxrlError(f"{PRELOAD_ENV}: unknown model kind {unknown[0]!r}: expected any of {', '.join(KIND_PRELOADS)}")
    return tuple(named)


def preload_for(*kinds: str) -> None:
    """Have the server import what rank processes of these model kinds import (`KIND_PRELOADS`; other kinds need
    nothing more) when it starts. A server already running keeps its imports."""
    _asked_kinds.update(kind for kind in kinds if kind in KIND_PRELOADS)


def preload_modules() -> list[str]:
    """What the server imports: PRELOAD, then the modules of the kinds asked for and of AXRL_PRELOAD, once each."""
    kinds = [kind for kind in KIND_PRELOADS if kind in _asked_kinds or kind in preload_kinds()]
    return list(dict.fromkeys((*PRELOAD, *(name for kind in kinds for name in KIND_PRELOADS[kind]))))


def import_installed(names: tuple[str, ...]) -> None:
    """Import each module that imports: one whose package is missing (or that fails) is left out, quietly. Their
    import-time warnings (megatron-core's "Apex is not installed") are not shown: the server writes to whatever
    standard error its launcher had when it started."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # a preload never stops the server; the rank meets the failure again
                log.debug("not preloaded: %s (%s)", name, exc)


def warm_up(kinds: tuple[str, ...] = ()) -> None:
    """Launch the forkserver now, without waiting for its imports: the next start forks at once. `kinds`: the
    job's model kinds, whose libraries it imports too (`preload_for`). No-op under spawn."""
    preload_for(*kinds)
    if start_method() == "forkserver":
        _ensure_server()


def _ensure_server() -> bool:
    from multiprocessing import forkserver

    with _lock:
        if _server_failed:
            return False
        forkserver.set_forkserver_preload(preload_modules())
        saved = {name: os.environ.get(name) for name in _SERVER_ENV}
        os.environ.update(_SERVER_ENV)  # inherited by the server only: it is launched from this process now
        try:
            forkserver.ensure_running()
        except (OSError, ValueError) as exc:
            _server_failed.append(f"{type(exc).__name__}: {exc}")
            log.warning("the process server could not start (%s); starting rank processes with spawn", exc)
            return False
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return True


def launcher_environment() -> dict[str, str]:
    """This process's environment, for a process it starts (`adopt_environment` there)."""
    return dict(os.environ)


def adopt_environment(environment: dict[str, str]) -> None:
    """Make this process's environment the launcher's (a process forked from the server has the server's)."""
    if environment == os.environ:
        return
    os.environ.clear()
    os.environ.update(environment)
    tempfile.tempdir = None  # TMPDIR may differ: the temp dir is looked up again


class LauncherStreams:
    """The launcher's standard output and error as they are when a process starts, for that process: pickled as
    the start method passes descriptors (`multiprocessing.reduction.DupFd`), applied there by `adopt_streams`."""

    FDS = (1, 2)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        sent = tuple((fd, reduction.DupFd(fd)) for fd in self.FDS if _is_open(fd))
        return (ReceivedStreams, (sent,))


class ReceivedStreams:
    """The launcher's descriptors as a started process received them (see `LauncherStreams`)."""

    def __init__(self, sent: tuple[tuple[int, Any], ...]) -> None:
        self.fds = [(target, dup.detach()) for target, dup in sent]


def adopt_streams(streams: LauncherStreams | ReceivedStreams | None) -> None:
    """Make this process's standard output and error the launcher's (a process forked from the server has the
    server's). Nothing to do when `streams` did not come through a start (the launcher's own object)."""
    if not isinstance(streams, ReceivedStreams):
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for target, fd in streams.fds:
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def die_with_launcher() -> None:
    """End this process as soon as the process that started it (its launcher) is gone, however that one died.

    For processes started through multiprocessing (forkserver, spawn or fork). On Linux the kernel sends SIGKILL
    when the process that forked this one exits (PR_SET_PDEATHSIG): the forkserver, or the launcher itself under
    spawn and fork. A forked-from-server process lets go of the server's "alive" pipe, so the server exits when the
    launcher does. The launcher may have died before all that was set, so its pipe is checked after; a watchdog
    thread on that pipe is the rest (where prctl is missing, and for a launcher that dies while the server lives).
    """
    launcher = multiprocessing.parent_process()
    if launcher is None:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    _let_go_of_the_server()
    if not launcher.is_alive():
        os._exit(1)
    threading.Thread(target=_watch_launcher, args=(launcher,), name="launcher-watch", daemon=True).start()


def _watch_launcher(launcher: BaseProcess) -> None:
    launcher.join()  # returns when the launcher's end of the pipe closes: it is gone
    os._exit(1)  # nobody will read our results, and we may hold a GPU


def _let_go_of_the_server() -> None:
    """Close this process's copy of the forkserver's "alive" pipe (every forked process inherits one).

    The server exits when no process holds that pipe open; while its children hold copies it would outlive a
    killed launcher, and so would they. multiprocessing keeps the descriptor in a private attribute (CPython
    3.8-3.13); where that is missing the watchdog thread still ends this process with the launcher.
    """
    from multiprocessing import forkserver

    if forkserver.get_inherited_fds() is None:  # not forked from a server (spawn, fork)
        return
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is None or not isinstance(fd, int):
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    server._forkserver_alive_fd = None
