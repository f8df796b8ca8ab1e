"""Find a job's role output directories (`<run>~<job>__<role>`) and their log files under output roots."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.layout import parse_output_dir_name
from axrl_spike_replay.untrusted.containment import inside_of
from axrl_spike_replay.untrusted.untrusted_bytes import file_kind

OUTPUT_ROOTS_ENV = "AXRL_OUTPUT_ROOTS"


@dataclass
class RoleDir:
    """One role's output directory of a job, with the logs found in it."""

    role: str
    output_dir: str
    logs: list[str] = field(default_factory=list)
    run: str = ""


@dataclass
class JobResolution:
    """What `resolve` found: the job's role output dirs (sorted by role, then run) and the roots searched."""

    job: str
    roles: list[RoleDir]
    roots: list[str]


def output_roots(roots: Iterable[str | Path] = ()) -> list[Path]:
    """The roots to search: those given, then `$AXRL_OUTPUT_ROOTS` (colon-separated); the cwd if neither."""
    found: list[Path] = [Path(r).expanduser() for r in roots if str(r)]
    found += [Path(r.strip()).expanduser() for r in os.environ.get(OUTPUT_ROOTS_ENV, "").split(":") if r.strip()]
    found = [Path(os.path.abspath(r)) for r in found]
    unique: list[Path] = []
    for root in found or [Path.cwd()]:
        if root not in unique:
            unique.append(root)
    return unique


@dataclass(frozen=True)
class LogEntries:
    """The entries named `*.log` of an output dir (`*.log` in it, `logs/**/*.log` below it), sorted, by kind."""

    inside: list[Path]  # regular files that stay inside the dir
    leaving: list[Path]  # entries whose path leads out of the dir through a symlink: never read
    not_regular: list[tuple[Path, str]]  # FIFOs, sockets, devices named *.log, with what each is: never opened


def log_entries(output_dir: str | Path) -> LogEntries:
    """The `*.log` entries of an output dir (see `LogEntries`); one stat and one resolve per entry."""
    directory = Path(output_dir)
    candidates = _named_logs(directory)
    logs_dir = directory / "logs"
    if logs_dir.is_dir():
        candidates += logs_dir.rglob("*.log")
    return classify_logs(candidates, directory)


def classify_logs(candidates: Iterable[Path], directory: Path) -> LogEntries:
    """Sort `candidates` found under `directory` into regular logs inside it, entries leading out, and entries
    that are no regular file (a broken symlink or a vanished entry is left out)."""
    within = inside_of(directory)
    inside: list[Path] = []
    leaving: list[Path] = []
    odd: list[tuple[Path, str]] = []
    for path in candidates:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode):
            continue
        if not within(path):
            leaving.append(path)
        elif stat.S_ISREG(mode):
            inside.append(path)
        else:
            odd.append((path, file_kind(mode)))
    return LogEntries(sorted(inside), sorted(leaving), sorted(odd))


def split_logs(output_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """Log files of an output dir (`*.log` in it, `logs/**/*.log` below it), sorted: (inside, leading out).

    A log (or the `logs` dir) that is a symlink leading out of the output dir is in the second list: never read.
    """
    entries = log_entries(output_dir)
    return entries.inside, entries.leaving


def _named_logs(directory: Path) -> list[Path]:
    """What `directory.glob("*.log")` gives (every entry named `*.log`; none when it is no readable directory),
    read with one `scandir` and no pattern to compile: `inspect` looks here on every call."""
    try:
        with os.scandir(directory) as entries:
            names = [entry.name for entry in entries if os.path.normcase(entry.name).endswith(".log")]
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    return [directory / name for name in names]


def find_logs(output_dir: str | Path) -> list[Path]:
    """Log files of an output dir that stay inside it (see `split_logs`)."""
    return split_logs(output_dir)[0]


def resolve_job(job: str, roots: Sequence[str | Path] = ()) -> JobResolution:
    """Every `*~<job>__<role>` directory directly under the roots (see `output_roots`), with its logs."""
    if not job or "/" in job:
        raise AxrlError(f"job name {job!r} is not valid (give the job name, e.g. 'qwen3-moe-grpo', not a path)")
    searched = output_roots(roots)
    roles: list[RoleDir] = []
    others: set[str] = set()  # the jobs the roots do hold, named in the error when `job` is not among them
    for root in searched:
        if not root.is_dir():
            continue
        for entry in sorted(root.iterdir()):
            parsed = parse_output_dir_name(entry.name)
            if parsed is None or not entry.is_dir():
                continue
            run, found, role = parsed
            if found != job:
                others.add(found)
                continue
            logs = [str(p) for p in find_logs(entry)]
            roles.append(RoleDir(role=role, output_dir=str(entry), logs=logs, run=run))
    if not roles:
        shown = ", ".join(str(r) + ("" if r.is_dir() else " (missing)") for r in searched)
        held = (
            f"; these roots hold job(s) {', '.join(repr(o) for o in sorted(others)[:10])} (a dir "
            "'<run>~<job>__<role>' is job <job>)"
            if others
            else f"; pass `roots` or set {OUTPUT_ROOTS_ENV}"
        )
        raise AxrlError(f"no output directories for job {job!r} (looked for '*~{job}__<role>' under: {shown}){held}")
    roles.sort(key=lambda r: (r.role, r.run, r.output_dir))
    return JobResolution(job=job, roles=roles, roots=[str(r) for r in searched])
