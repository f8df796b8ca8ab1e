"""A replay's output dir (in a workspace: `tmp/spike-replay/<job>/<timestamp>/`) with command, log and results.

The engine, and the runs on a node or with the command backend, write into a dir they are given; where that dir
lies and who is told about the run is the caller's business (`RunRecorder`; `investigation.recording` puts it in
the workspace and the task file).

Results are written atomically and only once the replay has finished: a reader sees a complete
`replay_result.json` or none. A run that fails after its dir exists writes a result whose verdict
is `failed`, with `grad_norm` null and the `error`, so it can never pass for a finished replay.
"""

from __future__ import annotations

import datetime as dt
import shlex
from pathlib import Path
from typing import Any, Protocol

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.files.atomic import atomic_write_json, atomic_write_text
from axrl_spike_replay.jsonable import to_jsonable

RESULT_FILE = "replay_result.json"
COMMAND_FILE = "command.txt"
BASELINE_COMMAND_FILE = "baseline_command.txt"  # beside a mitigated or hypothesis run: the same replay, no configs
LOG_FILE = "replay.log"
SWEEP_FILE = "sweep_result.json"  # a sweep's summary, beside its configs' dirs


def now_iso() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class RunDir:
    """One replay command's output dir; `path` is None when no workspace was given (nothing is written)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._log: list[str] = []

    @classmethod
    def new_in(cls, parent: Path) -> RunDir:
        """A new `<parent>/<timestamp>/` (a suffix keeps it unique)."""
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        parent.mkdir(parents=True, exist_ok=True)
        for n in range(1000):
            path = parent / (stamp if n == 0 else f"{stamp}-{n}")
            try:
                path.mkdir()
                return cls(path)
            except FileExistsError:
                continue
        raise FileExistsError(f"{parent}: no free timestamp dir for {stamp}")

    def write_command(self, command: str, baseline: str | None = None) -> None:
        """Write the run's command line; `baseline`: the baseline's (the same replay without its configs), when the
        run replays configs beside the baseline."""
        if self.path is not None:
            atomic_write_text(self.path / COMMAND_FILE, command.rstrip("\n") + "\n")
            if baseline is not None:
                atomic_write_text(self.path / BASELINE_COMMAND_FILE, baseline.rstrip("\n") + "\n")

    def log(self, line: str) -> None:
        """Append a line to the run's log (written out by `flush_log`)."""
        self._log.append(f"{dt.datetime.now().strftime('%H:%M:%S')} {line}")
        self.flush_log()

    def flush_log(self) -> None:
        if self.path is not None:
            atomic_write_text(self.path / LOG_FILE, "\n".join(self._log) + "\n")

    def result_path(self, sub: str | None = None) -> Path | None:
        if self.path is None:
            return None
        return self.path / sub / RESULT_FILE if sub else self.path / RESULT_FILE

    def write_result(self, result: ReplayResult, sub: str | None = None) -> Path | None:
        """Write `replay_result.json` (under `sub/` when given) atomically; its path."""
        path = self.result_path(sub)
        if path is None:
            return None
        result.output_dir = str(path.parent)
        atomic_write_json(path, to_jsonable(result))
        return path

    def write_json(self, name: str, doc: Any) -> Path | None:
        if self.path is None:
            return None
        return atomic_write_json(self.path / name, to_jsonable(doc))


class RunRecorder(Protocol):
    """Where a run's output goes and who is told about it; the engine calls it, orchestration provides it."""

    def open_run(self, job: str) -> RunDir:
        """A new output dir for a run of `job`."""
        ...

    def replayed(self, job: str, result: ReplayResult, path: Path) -> str | None:
        """A finished result written at `path`; the id it was recorded under, if any."""
        ...

    def failed(self, job: str, *, reason: str, command: str, snapshot: str, result_path: Path | None) -> str | None:
        """A run that failed after its output dir was made; the id it was recorded under, if any."""
        ...


def write_and_record(
    run: RunDir, result: ReplayResult, recorder: RunRecorder | None, job: str, sub: str | None = None
) -> Path | None:
    """Write `replay_result.json` (atomically, under `sub/` when given), then hand it to the recorder: the way a
    run on a node or with the command backend records, as the engine's own runs do (`ReplaySession.record`)."""
    path = run.write_result(result, sub)
    if path is not None and recorder is not None:
        exp_id = recorder.replayed(job, result, path)
        if exp_id:
            run.log(f"{result.config_id}: logged in the task file of job {job} as {exp_id}")
    return path


def command_line(verb: str, snapshot: str, options: dict[str, Any]) -> str:
    """The equivalent CLI command for a library call, for `command.txt`."""
    parts = ["axrl-spike-replay", verb, snapshot]
    for key, value in options.items():
        if value is None or value is False or value == [] or value == {}:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            for item in value:
                parts += [flag, str(item)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)
