"""Run a function in one process per rank under torch.distributed (the trainer's and the replay's launcher).

Processes come from `process_starts` (forked from a server that imported torch once, or spawned where that is
unavailable) and meet over a FileStore in a private temp dir. They die with the launcher however it dies (see
`process_starts.die_with_launcher`), and the temp dir is removed by a watcher process if the launcher cannot
(see `temp_janitor`): a killed replay never leaves ranks holding GPUs. Each runs with one intra-op thread, so
reductions are deterministic and match between capture and replay.

Teardown is ordered. A rank that closes its gloo connections while a peer is still inside a collective with it
can make that peer abort in gloo's native code (`terminate called without an active exception`, SIGABRT). A
barrier alone does not prevent it: the first rank out of the final barrier may tear down while its peer has not yet
returned from that barrier. So every rank passes the barrier, then says so in the FileStore (which needs no socket)
and waits until every rank has said so; only then does any rank destroy the group. Each rank then leaves a `done`
file: a rank killed by a signal after every rank's work was done (an abort in teardown or at exit) loses nothing,
so the launcher logs it and the run succeeds instead of failing after its results were written.

A started process imports the launcher's main module again before it runs anything of ours (forkserver and
spawn both do). A script that starts a run at module level (no `if __name__ == "__main__":`) would start it
again in every rank process; `refuse_in_spawned_import` stops that in the child (the library's entry points
call it first) and leaves a note in the run's temp dir (named in the process's name) that the launcher turns
into the one message that says what to do.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.files.atomic import atomic_write_text
from axrl_spike_replay.files.temp_janitor import owned_temp_dir
from axrl_spike_replay.processes.process_starts import (
    LauncherStreams,
    adopt_environment,
    adopt_streams,
    die_with_launcher,
    launcher_environment,
    rank_context,
)

RankFn = Callable[[int, int, Any], None]
log = logging.getLogger("axrl_spike_replay.ranks")
_POLL_S = 0.2
_GRACE_S = 5.0
# A rank process is named "<label> <rank> @ <run's temp dir>": a child re-importing the main module (multiprocessing
# sets the name before that import) finds the run's temp dir there and leaves its note (REIMPORT_NOTE) for the launcher.
_RUN_DIR_MARK = " @ "
_REIMPORT_NOTE = "reimport.txt"
_STARTED = "started-{rank:05d}"  # written by each rank first thing: it got past the import of the main module
_DONE = "done-{rank:05d}"  # written by each rank once every rank finished its work, before the group is torn down
_LEFT_KEY = "axrl-left-collectives"  # FileStore counter: ranks that returned from their last collective


class RankProcessError(AxrlError):
    """A rank process failed; `details` holds its traceback when the failure was not expected input."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class RunCancelled(RankProcessError):
    """The caller cancelled the run; its processes were stopped."""


def check_cancel(cancel: threading.Event | None, what: str = "run") -> None:
    """Raise RunCancelled when `cancel` is set."""
    if cancel is not None and cancel.is_set():
        raise RunCancelled(f"{what} cancelled")


def _main_module() -> str | None:
    """The launcher's main module as a spawned process imports it again (its file or module name), else None.
    In a spawned process re-importing it, that module is `__mp_main__` (multiprocessing's name for it)."""
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(main, "__file__", None) or getattr(spec, "name", None)


def main_guard_advice(what: str) -> str:
    """What to do when a spawned process re-imports a main module that starts `what` at import."""
    return (
        f"{what} was started again while a rank process imported your main module {_main_module() or '__main__'}: "
        "each rank process imports the main module anew (multiprocessing's forkserver and spawn both do). Put the "
        'code that starts it under `if __name__ == "__main__":` in that script'
    )


def refuse_in_spawned_import(what: str) -> None:
    """AxrlError (and a note for the launcher) when called while a spawned process imports the main module again:
    the script started `what` at module level and would start it once more in every rank process."""
    import multiprocessing

    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    message = main_guard_advice(what)
    name = multiprocessing.current_process().name
    run_dir = name.partition(_RUN_DIR_MARK)[2] if _RUN_DIR_MARK in name else ""
    if run_dir and Path(run_dir).is_dir():
        with contextlib.suppress(OSError):
            atomic_write_text(Path(run_dir, _REIMPORT_NOTE), message)
    raise AxrlError(message)


def spawn_ranks(
    fn: RankFn,
    nproc: int,
    payload: Any,
    *,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    prepare: Callable[[int, Any], None] | None = None,
    label: str = "rank",
    cancel: threading.Event | None = None,
    native_crash_retries: int = 0,
) -> None:
    """Run `fn(rank, nproc, payload)` in `nproc` spawned processes joined in one process group.

    `fn` and `prepare` must be module-level functions (they are pickled). `prepare(rank, payload)`
    runs before the group is made (e.g. to pick the rank's GPU). An AxrlError in a rank is raised
    here with that rank's message; any other failure raises RankProcessError with its traceback.
    Setting `cancel` stops every process (SIGTERM, then SIGKILL) and raises RunCancelled.
    `native_crash_retries` reruns the whole group when a process was killed by a signal before it
    could report anything (rare aborts in gloo's native code under load); only for side-effect-free work.
    """
    if nproc < 1:
        raise AxrlError(f"number of processes must be >= 1, got {nproc}")
    refuse_in_spawned_import(f"a run of {nproc} {label} processes")
    for attempt in range(1 + native_crash_retries):
        try:
            _spawn_once(fn, nproc, payload, backend, timeout_s, prepare, label, cancel)
            return
        except _NativeCrash as crash:
            if attempt == native_crash_retries:
                raise RankProcessError(str(crash), crash.details) from None
            log.warning("%s; running the %s processes again (their work has no side effects)", crash, label)


_CRASH_SIGNALS = {int(signal.SIGABRT), int(signal.SIGSEGV), int(signal.SIGBUS), int(signal.SIGILL), int(signal.SIGFPE)}


class _NativeCrash(RankProcessError):
    """A process died from a signal before it could report (a crash in native code)."""


def _spawn_once(
    fn: RankFn,
    nproc: int,
    payload: Any,
    backend: str,
    timeout_s: float,
    prepare: Callable[[int, Any], None] | None,
    label: str,
    cancel: threading.Event | None,
) -> None:
    import torch.multiprocessing  # noqa: F401  (its pickling of tensors: shared memory, as torch's own spawn uses)

    context = rank_context()
    environment = launcher_environment()
    streams = LauncherStreams()
    with owned_temp_dir("axrl-ranks-") as tmp:
        processes: list[Any] = []
        try:
            for rank in range(nproc):
                args = (rank, fn, nproc, payload, backend, tmp, timeout_s, prepare, label, environment, streams)
                process = context.Process(target=_entry, args=args, name=f"{label} {rank}{_RUN_DIR_MARK}{tmp}")
                process.start()
                processes.append(process)
            failed = _join(processes, cancel, label)
            if failed is None:
                return
            # Before we stop the others: which ranks a signal killed (a native crash), as opposed to ranks that
            # then failed in Python because a peer vanished (those report a trace, which must not win the race).
            exitcodes = [process.exitcode or 0 for process in processes]
            signalled = [rank for rank, code in enumerate(exitcodes) if -code in _CRASH_SIGNALS]
            if exitcodes[failed] < 0 and failed not in signalled:
                signalled.append(failed)
            _stop(processes)
            if _all_done(Path(tmp), nproc) and not list(Path(tmp).glob("*-*.txt")):
                # every rank's work was done and agreed before any teardown: the results stand
                log.warning(
                    "%s process(es) %s died from a signal while tearing down, after every %s finished its work "
                    "(exit codes %s); the run's results are complete",
                    label,
                    ", ".join(str(r) for r, code in enumerate(exitcodes) if code),
                    label,
                    exitcodes,
                )
                return
            crashed = [rank for rank in signalled if not list(Path(tmp).glob(f"*-{rank:05d}.txt"))]
            if crashed:
                raise _native_crash(Path(tmp), crashed[0], exitcodes[crashed[0]], label) from None
            raise _collect_error(Path(tmp), _exit_description(failed, exitcodes[failed]), label) from None
        except BaseException:
            _stop(processes)  # Ctrl-C, SIGTERM (see `terminate_as_interrupt`), any bug: no rank outlives us
            raise


def _join(processes: list[Any], cancel: threading.Event | None, label: str) -> int | None:
    """Wait for every process: None when all exited cleanly, else the first seen to fail (others still running)."""
    from multiprocessing.connection import wait

    while True:
        if cancel is not None and cancel.is_set():
            _stop(processes)
            raise RunCancelled(f"{label} processes cancelled and stopped")
        codes = [process.exitcode for process in processes]
        failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
        if failed is not None:
            return failed
        if all(code == 0 for code in codes):
            return None
        wait([process.sentinel for process in processes if process.exitcode is None], timeout=_POLL_S)


def _exit_description(rank: int, code: int) -> str:
    if code < 0:
        try:
            return f"process {rank} was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"process {rank} was killed by signal {-code}"
    return f"process {rank} exited with code {code}"


def _all_done(tmp: Path, nproc: int) -> bool:
    return all(Path(tmp, _DONE.format(rank=rank)).exists() for rank in range(nproc))


def leave_collectives(store: Any, nproc: int, timeout_s: float) -> None:
    """Say in the store that this rank left its last collective, and wait until every rank has: then no rank tears
    down its connections while a peer may still be inside a collective with it."""
    store.add(_LEFT_KEY, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(_LEFT_KEY, 0) < nproc:
        if time.monotonic() > deadline:
            raise RankProcessError(f"the other ranks did not finish within {timeout_s:g} s of this one")
        time.sleep(0.005)


def terminate_as_interrupt() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread, so it stops and cleans up as Ctrl-C does.

    For command-line entry points (call from the main thread): a killed `replay` then stops its rank
    processes and removes its temp dirs instead of dying with them still running.
    """

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"terminated by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def _native_crash(tmp: Path, rank: int, exitcode: int, label: str) -> _NativeCrash:
    """A rank killed by a signal before its Python could report; other ranks' traces are the consequences."""
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    others = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(tmp.glob("*-*.txt")))
    return _NativeCrash(f"{label} process {rank} died from {name} (a crash in native code)", others)


def _collect_error(tmp: Path, exit_description: str, label: str) -> RankProcessError:
    note = tmp / _REIMPORT_NOTE
    if note.is_file():  # a rank re-ran the script's run at import: the one thing to say
        return RankProcessError(note.read_text(encoding="utf-8", errors="replace").strip())
    expected = sorted(tmp.glob("error-*.txt"))
    if expected:
        return RankProcessError(expected[0].read_text(encoding="utf-8").strip())
    traces = sorted(tmp.glob("trace-*.txt"))
    if traces:
        text = traces[0].read_text(encoding="utf-8")
        last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
        return RankProcessError(f"{label} {traces[0].stem.removeprefix('trace-')}: {last}", text)
    first = exit_description
    if not list(tmp.glob("started-*")):  # no rank got past importing the main module and its function
        main = _main_module()
        hint = (
            f" Each imports your main module {main} again first: if it starts a run when imported, put that code "
            'under `if __name__ == "__main__":`'
            if main
            else ""
        )
        return RankProcessError(
            f"the {label} processes died while starting ({first}), before any ran its work; their output above "
            f"says why.{hint}",
            exit_description,
        )
    return RankProcessError(f"a {label} process died: {first}", exit_description)


def _entry(
    rank: int,
    fn: RankFn,
    nproc: int,
    payload: Any,
    backend: str,
    tmp: str,
    timeout_s: float,
    prepare: Callable[[int, Any], None] | None,
    label: str,
    environment: dict[str, str],
    streams: LauncherStreams | None = None,
) -> None:
    die_with_launcher()
    adopt_environment(environment)
    adopt_streams(streams)
    Path(tmp, _STARTED.format(rank=rank)).touch()  # past the import of the main module and of `fn`
    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a native abort (gloo, CUDA) still prints where Python was
    torch.set_num_threads(1)
    try:
        if prepare is not None:
            prepare(rank, payload)
        # FileStore is public torch.distributed API, re-exported from torch's C extension without an __all__ entry
        store = dist.FileStore(str(Path(tmp) / "store"), nproc)  # pyright: ignore[reportPrivateImportUsage]
        dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=timedelta(seconds=timeout_s))
        fn(rank, nproc, payload)
        dist.barrier()  # every rank is done with its work
        leave_collectives(store, nproc, timeout_s)  # and has returned from that barrier: teardown may start
        Path(tmp, _DONE.format(rank=rank)).touch()
    except AxrlError as exc:  # expected: its message is the report, no traceback on the terminal
        atomic_write_text(Path(tmp, f"error-{rank:05d}.txt"), f"{label} {rank}: {exc}")
        sys.exit(1)
    except BaseException:
        atomic_write_text(Path(tmp, f"trace-{rank:05d}.txt"), traceback.format_exc())
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
