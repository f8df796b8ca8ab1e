"""Copy a job's training logs into the workspace and scan them: grad-norm/loss series, spikes, error lines.

Lines are read by `log_lines` (Megatron-style and key=value lines, error kinds), streamed by `log_reader`
(large binary reads, per-line work only for lines that can match, memory flat in the file size), and the
series held by `log_series` (typed arrays, a few bytes per iteration; `SeriesPoints` reads them as dicts).

Spikes are found by the spike guard's own detector (`capture.detectors`, ratio to the rolling
median of healthy norms by default), with the run's own detector settings where its snapshots
hold them, run over the series in iteration order: armed from step 1 as the guard is, so a spike in the
warm-up part of a log (a norm far above the first steps' median, or a non-finite one) is flagged the same way
(`warm_up: true`); `warmup_ratio: off` scans with a blind warm-up.

Logs are untrusted text: every pattern runs in time linear in the line, a line is never held past
`MAX_LINE_CHARS` (longer ones are counted and skipped), and no symlink is followed out of the log dirs
read or the copy dir written.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from axrl_spike_replay.capture.detectors import DEFAULT_WARMUP_RATIO, Detector, MedianRatioDetector, make_detector
from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.logs.log_copy import CopyBeside, PlannedCopy, plan_copies
from axrl_spike_replay.logs.log_halves import SecondHalf, can_fork, cut_point
from axrl_spike_replay.logs.log_lines import error_kind, key_values, parse_line
from axrl_spike_replay.logs.log_reader import MAX_ERRORS, MAX_LINE_CHARS, LogTally, scan_handle
from axrl_spike_replay.logs.log_series import SeriesPoints
from axrl_spike_replay.logs.series_sampling import DEFAULT_LIMIT, sampled_series
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.snapshot.discovery import classify_logs, log_entries
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, RUN_CONFIG, SNAPSHOTS_DIR, parse_output_dir_name
from axrl_spike_replay.untrusted.containment import resolved_text
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, file_kind, open_regular
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

MAX_SKIPPED = 200
# the guard's defaults, armed from step 1 as it is (capture.detectors): a spike in the warm-up part of a log is flagged
_DEFAULT_DETECTOR: dict[str, Any] = {
    "kind": "median_ratio",
    "window": 20,
    "threshold": 5.0,
    "warmup": 10,
    "warmup_ratio": DEFAULT_WARMUP_RATIO,
    "max_norm": None,
}
_DETECTOR_KEYS = tuple(_DEFAULT_DETECTOR)

__all__ = [
    "MAX_ERRORS",
    "MAX_LINE_CHARS",
    "LogScan",
    "error_kind",
    "key_values",
    "parse_line",
    "scan_logs",
    "with_sampled_series",
]


@dataclass
class LogScan:
    """What `logs` reports. `series_points` is one point per iteration (the last logged value wins): from
    `scan_logs`, a compact sequence (`SeriesPoints`, dicts made when read); `with_sampled_series` makes it a list.

    `long_lines`: lines longer than `MAX_LINE_CHARS`, left out of the series (their start is still checked
    for errors). `skipped`: log entries not copied, each {path, reason} (e.g. a symlink leading out).
    """

    name: str
    dest: str
    copied: list[str]
    series_points: Sequence[dict[str, Any]]
    spikes: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    error_lines: int = 0
    lines: int = 0
    repeated_iterations: int = 0
    detector: dict[str, Any] = field(default_factory=dict)
    long_lines: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    series_total: int = 0  # iterations in the whole series; `series_points` may hold a sample of them
    series_sampled: bool = False


def with_sampled_series(scan: LogScan, limit: int | None = DEFAULT_LIMIT) -> LogScan:
    """`scan` with its series as a list down-sampled to about `limit` points (spikes and their neighbourhoods
    exact), or every point when `limit` is None."""
    if limit is None:
        return dataclasses.replace(scan, series_points=list(scan.series_points))
    points = sampled_series(scan.series_points, [s["iteration"] for s in scan.spikes], limit=limit)
    sampled = len(points) < len(scan.series_points)
    return dataclasses.replace(scan, series_points=points, series_sampled=sampled or scan.series_sampled)


def _leaves(entry: Path, root: Path) -> str:
    """Why `entry`, found under `root`, is not read: a symlink on its way leads out of `root`."""
    return f"leads outside {root} through a symlink (to {resolved_text(entry)}); not followed"


def _log_files(paths: Sequence[str | Path]) -> tuple[list[tuple[Path, Path]], list[dict[str, str]]]:
    """(log file, path relative to the copy dest) for each given file, or each log in a given dir; and the
    entries of given dirs skipped: leading out of that dir, or no regular file (a FIFO is never opened)."""
    found: list[tuple[Path, Path]] = []
    skipped: list[dict[str, str]] = []
    for given in paths:
        path = Path(given)
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise AxrlError(f"{path}: cannot read it ({exc.strerror or exc})") from None
            why = " (a symlink that is broken or a loop)" if path.is_symlink() else ""
            raise AxrlError(f"{path}: log file or directory not found{why}") from None
        if stat.S_ISREG(mode):
            found.append((Path(os.path.abspath(path)), Path(path.name)))  # named by the caller: read as given
        elif stat.S_ISDIR(mode):
            entries = log_entries(path)
            if not (entries.inside or entries.leaving or entries.not_regular):
                entries = classify_logs(path.rglob("*.log"), path)
            skipped += [{"path": str(log), "reason": _leaves(log, path)} for log in entries.leaving]
            skipped += [
                {"path": str(log), "reason": f"is {kind}, not a log file; not read"}
                for log, kind in entries.not_regular
            ]
            if not entries.inside and not entries.leaving and not entries.not_regular:
                raise AxrlError(f"{path}: no *.log files in it or under its logs/")
            found += [(Path(os.path.abspath(log)), Path(path.name) / log.relative_to(path)) for log in entries.inside]
        else:
            raise AxrlError(f"{path}: is {file_kind(mode)}, not a log file or directory; refusing to read it")
    return found, skipped


def default_name(paths: Sequence[str | Path]) -> str:
    """The job name of the first path's output dir (`<run>~<job>__<role>`), else its name.

    The name comes from a directory we did not name: check it (`check_plain_name`) before it becomes a path.
    """
    try:
        first = Path(paths[0]).resolve()
    except (OSError, RuntimeError):  # RuntimeError: pathlib's "Symlink loop"; reading it will say what is wrong
        first = Path(os.path.abspath(paths[0]))
    for candidate in (first, *first.parents):
        parsed = parse_output_dir_name(candidate.name)
        if parsed:
            return parsed[1]
    return first.stem if first.is_file() else first.name


def run_detector_config(paths: Sequence[str | Path]) -> tuple[dict[str, Any], str | None]:
    """The `detector:` section of the run's config, from the newest snapshot of the first path's output dir."""
    first = Path(os.path.abspath(paths[0]))
    for candidate in (first, *first.parents):
        if parse_output_dir_name(candidate.name) is None:
            continue
        configs = [c for sub in (SNAPSHOTS_DIR, PRESERVED_DIR) for c in (candidate / sub).glob(f"iter_*/{RUN_CONFIG}")]
        for config in sorted(configs, key=lambda c: c.parent.name, reverse=True):
            if not config.is_file():  # a FIFO or device would block or never end
                continue
            try:
                doc = read_untrusted_yaml(config, "run config", within=config.parent) or {}
            except AxrlError:
                continue
            section = doc.get("detector") if isinstance(doc, dict) else None
            if isinstance(section, dict):
                return {k: section[k] for k in _DETECTOR_KEYS if k in section}, str(config)
        break
    return {}, None


def _spikes(series: Sequence[dict[str, Any]], detector: Detector) -> list[dict[str, Any]]:
    """The points of `series` the detector trips on, observed in order.

    A median-ratio detector past warm-up cannot trip on a finite norm at most `threshold` x the window's
    smallest (positive) norm, the median being at least that: such a norm joins the window without the median
    being taken (the same window and trips as `observe`, at a fraction of its cost on long series). Runs of
    such norms are found with array operations (`_quiet_run`), the window's smallest norm at each point being
    that of the norms before it as long as none of them trips.
    """
    if isinstance(series, SeriesPoints):
        logged = (series.flags & 1) == 1
        iterations, array = series.iterations, series.grads
        if not logged.all():
            iterations, array = iterations[logged], array[logged]
    else:
        points = [p for p in series if p["grad_norm"] is not None]
        iterations = np.array([p["iteration"] for p in points], dtype=object)
        array = np.array([p["grad_norm"] for p in points], dtype=np.float64)
    quick = detector if isinstance(detector, MedianRatioDetector) else None
    below = detector.threshold * (1 - 1e-9)  # margin: value / median <= value / smallest < threshold, rounded
    spikes = []
    at, stretch = 0, _FIRST_STRETCH
    while at < len(array):
        # right after a norm that was judged, the next one is checked alone first: a series where most norms
        # are judged (all zero, all NaN) costs no array work
        history = quick.history if quick is not None else None
        if (
            history is not None
            and detector.settled  # past the warm-up's own rules (and a max_norm's window)
            and (stretch > _FIRST_STRETCH or _quiet(float(array[at]), history, below))
        ):
            chunk = array[at : at + stretch]
            run = _quiet_run(history, detector.window, chunk, below)
            history.extend(array[at : at + run].tolist())
            at += run
            if run == len(chunk):
                stretch = min(2 * stretch, _LONGEST_STRETCH)
                continue
            stretch = _FIRST_STRETCH
        seen = detector.observe(float(array[at]))
        if seen.tripped:
            spikes.append(
                {
                    "iteration": int(iterations[at]),
                    "grad_norm": seen.grad_norm,
                    "spike_ratio": seen.spike_ratio,
                    "median_norm": None if math.isnan(seen.median_norm) else seen.median_norm,
                    "warm_up": seen.warming_up,  # flagged by the warm-up's own rule, or a non-finite norm there
                    "rule": seen.rule,
                }
            )
        at += 1
    return spikes


_FIRST_STRETCH, _LONGEST_STRETCH = 64, 1 << 16


def _quiet(norm: float, history: deque[float], below: float) -> bool:
    smallest = min(history)
    return math.isfinite(norm) and smallest > 0 and norm <= below * smallest


def _quiet_run(history: deque[float], window: int, norms: np.ndarray, below: float) -> int:
    """How many of `norms`, from the first, a settled median-ratio detector with this `history` takes into its
    window without taking the median: finite, and at most `below` x the smallest (positive) norm of the window
    before (that of the norms before it, none of them having tripped)."""
    held = np.array(history, dtype=np.float64)
    padded = np.concatenate([np.full(window - len(held), np.inf), held, norms])
    smallest = _window_min(padded, window)[: len(norms)]
    quiet = np.isfinite(norms) & (smallest > 0) & (norms <= below * smallest)
    stops = np.flatnonzero(~quiet)
    return int(stops[0]) if stops.size else len(norms)


def _window_min(values: np.ndarray, width: int) -> np.ndarray:
    """min(values[i : i + width]) for each i with a full window, by doubling spans (log2(width) passes)."""
    spans, span = values, 1
    while 2 * span <= width:
        spans = np.minimum(spans[:-span], spans[span:])
        span *= 2
    return np.minimum(spans[: len(values) - width + 1], spans[width - span : width - span + len(values) - width + 1])


def _check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise AxrlError(f"log scan cancelled {where}")


def _copy_and_scan(copy: PlannedCopy, tally: LogTally, cancel: threading.Event | None) -> None:
    """Scan one log while a thread copies it (`log_copy`), a large one on two cores (`log_halves`); a scan that
    fails stops the copy (no file left) and the other half."""
    try:
        opened = open_regular(copy.source)  # never waits on a FIFO put in the log's place since it was listed
    except UntrustedInputError as exc:
        raise AxrlError(f"{copy.source}: {exc}; not read") from None
    with opened as handle:
        size = os.fstat(handle.fileno()).st_size
        cut = cut_point(handle.fileno(), size) if can_fork() else None
        second = SecondHalf(handle, cut, size, copy.target) if cut is not None else None  # forked before any thread
        copier = None if copy.in_place else CopyBeside(handle, copy.source, copy.target, size, cancel)
        if copier is not None:
            copier.begin()
        try:
            scan_handle(handle, copy.target, tally, cancel, limit=size if cut is None else cut)
            if second is not None:
                second.add_to(tally, cancel)
        except BaseException:
            if second is not None:
                second.stop()
            if copier is not None:
                copier.end()
            raise
        if copier is not None:
            copier.finish()


def scan_logs(
    paths: Sequence[str | Path],
    dest: str | Path | None = None,
    *,
    window: int | None = None,
    threshold: float | None = None,
    warmup: int | None = None,
    warmup_ratio: float | str | None = None,
    max_norm: float | None = None,
    progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    root: str | Path | None = None,
) -> LogScan:
    """Copy logs (files, or dirs holding `*.log` / `logs/*.log`) to `dest` and scan the copies.

    `progress` receives a line per log file scanned; setting `cancel` stops the copy or the scan within a
    few hundred lines (AxrlError). `dest` defaults to `./tmp/spike-replay/<job or name>/logs` in the current
    workspace. The copies must stay inside `root` (default: the current workspace when `dest` defaults,
    else `dest` itself): a copy dir that resolves outside is refused, and an entry whose folder leads out
    is skipped and reported. Detector settings not given come from the run's own config (the `detector:`
    section of the newest snapshot's `run_config.yaml` in the logs' output dir), else the guard's defaults.
    """
    if not paths:
        raise AxrlError("give at least one log file or directory")
    found, source = run_detector_config(paths)
    settings = {**_DEFAULT_DETECTOR, **found}
    given = {"window": window, "threshold": threshold, "warmup": warmup, "warmup_ratio": warmup_ratio}
    settings.update({k: v for k, v in given.items() if v is not None})
    if max_norm is not None:
        settings["max_norm"] = max_norm
    if isinstance(settings["warmup_ratio"], str) and settings["warmup_ratio"].strip().lower() == "off":
        settings["warmup_ratio"] = None  # a blind warm-up, as the guard had before it was armed from step 1
    try:
        ratio, ceiling = settings["warmup_ratio"], settings["max_norm"]
        detector = make_detector(
            str(settings["kind"]),
            window=int(settings["window"]),
            threshold=float(settings["threshold"]),
            warmup=int(settings["warmup"]),
            warmup_ratio=float(ratio) if ratio is not None else None,
            max_norm=float(ceiling) if ceiling is not None else None,
        )
    except (TypeError, ValueError) as exc:
        problem = shown(str(exc), quote=False)
        raise ConfigError(f"detector settings {shown(settings)} are not valid ({problem})") from None
    files, skipped = _log_files(paths)
    name = default_name(paths)
    if dest is not None:
        target = Path(os.path.abspath(dest))
    else:
        check_plain_name(name, f"job name (from {shown(str(paths[0]), 120, quote=False)}; pass a dest dir instead)")
        target = Path.cwd() / "tmp" / "spike-replay" / name / "logs"
    within = Path(os.path.abspath(root)) if root is not None else (target if dest is not None else Path.cwd())
    try:
        copies, not_copied = plan_copies(files, target, within)
    except OSError as exc:
        raise AxrlError(f"{exc.filename or target}: cannot copy the logs ({exc.strerror or exc})") from None
    skipped += not_copied

    tally = LogTally()
    for done, copy in enumerate(copies, start=1):
        if done > 1:
            _check_cancel(cancel, f"after {done - 1} of {len(copies)} file(s)")
        _check_cancel(cancel, f"while copying {copy.source}")
        if progress is not None:
            progress(f"scanning {copy.target.name} ({done}/{len(copies)})")
        try:
            _copy_and_scan(copy, tally, cancel)
        except OSError as exc:
            raise AxrlError(f"{exc.filename or copy.source}: cannot read the log ({exc.strerror or exc})") from None

    series, repeated = tally.series.settled()
    spikes = _spikes(series, detector)
    return LogScan(
        name=name,
        dest=str(target),
        copied=[str(c.target) for c in copies],
        series_points=series,
        spikes=spikes,
        errors=tally.errors,
        error_lines=tally.error_lines,
        lines=tally.lines,
        repeated_iterations=repeated,
        detector={**detector.config(), "source": source or "defaults"},
        long_lines=tally.long_lines,
        skipped=skipped[:MAX_SKIPPED],
        series_total=len(series),
    )
