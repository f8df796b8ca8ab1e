"""Copy a job's training logs into the workspace and scan them: grad-norm/loss series, spikes, error lines.

Understood line formats (both streamed line by line, so logs of any size are fine):
- Megatron-style: `iteration 12/ 1000 | ... | lm loss: 1.2E+00 | ... | grad norm: 3.4 | ...`
- key=value (or key:value): `step=12 grad_norm=3.4 loss=0.1`, `step:12 - actor/grad_norm:3.4 - actor/pg_loss:0.1`

Spikes are found by the spike guard's own detector (`capture.detectors`, ratio to the rolling
median of healthy norms by default), with the run's own detector settings where its snapshots
hold them, run over the series in iteration order.

Logs are untrusted text: every pattern here runs in time linear in the line, a line is never
read past `MAX_LINE_CHARS` (longer ones are counted and skipped), and no symlink is followed out of
the log dirs read or the copy dir written.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.atomic import temp_beside
from axrl_spike_replay.capture.detectors import make_detector
from axrl_spike_replay.containment import is_inside, resolved_text
from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.snapshot.discovery import split_logs
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, RUN_CONFIG, SNAPSHOTS_DIR, parse_output_dir_name
from axrl_spike_replay.untrusted_yaml import read_untrusted_yaml
from axrl_spike_replay.workspace.paths import check_plain_name

MAX_ERRORS = 200
MAX_SKIPPED = 200
# A training log line is at most a few KB; longer ones are skipped (only their start is checked for errors).
MAX_LINE_CHARS = 64 * 1024
_COPY_CHUNK = 1024 * 1024
_CANCEL_EVERY_LINES = 256
_DEFAULT_DETECTOR: dict[str, Any] = {"kind": "median_ratio", "window": 20, "threshold": 5.0, "warmup": 10}
_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf(?:inity)?)"
_MEGATRON = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|(.*)", re.IGNORECASE)
# `key=value` pairs, found in linear time. A key is a run of [\w./-] from its first letter; the key can only
# end where its run ends, so when the first letter of a run fails every later start in it fails too. The
# pattern therefore starts only at a run's start (or right after the previous pair, `_KV_AT`), skips the
# run's leading non-letters and matches key, separator and number possessively: no start is retried inside
# a run and nothing backtracks (a plain `[A-Za-z_][\w./-]*` search is quadratic on a long word).
# Same pairs as `([A-Za-z_][\w./-]*)\s*[=:]\s*(NUM)(?![\w.])` with findall.
_KV_BODY = rf"(?:(?![A-Za-z_])[\w./-])*+([A-Za-z_][\w./-]*+)\s*+[=:]\s*+((?>{_NUM}))(?![\w.])"
_KV_AT = re.compile(_KV_BODY, re.IGNORECASE)
_KV_START = re.compile(rf"(?<![\w./-]){_KV_BODY}", re.IGNORECASE)
_STEP_KEYS = {"step", "iteration", "iter", "global_step", "it"}
_GRAD_KEYS = {"grad_norm", "gradnorm", "grad_norm_pre_clip", "global_grad_norm", "total_grad_norm"}
_LOSS_KEYS = ("lm_loss", "loss", "total_loss", "train_loss", "policy_loss", "pg_loss")
# Each of these is linear: one `\b` start per word and no nested or adjacent overlapping repeats.
_ERRORS = (
    ("traceback", re.compile(r"Traceback \(most recent call last\)")),
    ("exception", re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b(?::|\s*$)")),
    ("error", re.compile(r"\b(?:ERROR|FATAL|CRITICAL)\b|CUDA out of memory|NCCL (?:error|timeout)", re.IGNORECASE)),
    ("non_finite", re.compile(r"[:=]\s*[-+]?(?:nan|inf(?:inity)?)\b", re.IGNORECASE)),
)


@dataclass
class LogScan:
    """What `logs` reports. `series_points` is one point per iteration (the last logged value wins).

    `long_lines`: lines longer than `MAX_LINE_CHARS`, left out of the series (their start is still checked
    for errors). `skipped`: log entries not copied, each {path, reason} (e.g. a symlink leading out).
    """

    name: str
    dest: str
    copied: list[str]
    series_points: list[dict[str, Any]]
    spikes: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    error_lines: int = 0
    lines: int = 0
    repeated_iterations: int = 0
    detector: dict[str, Any] = field(default_factory=dict)
    long_lines: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)


def _leaf(key: str) -> str:
    return key.rsplit("/", 1)[-1].lower().replace("-", "_").replace(" ", "_")


def _float(text: str) -> float:
    return float(text)


def key_values(line: str) -> list[tuple[str, str]]:
    """The `key=value` / `key:value` pairs (numeric values) of a line, left to right, in linear time."""
    pairs: list[tuple[str, str]] = []
    match = _KV_START.search(line)
    while match:
        pairs.append((match.group(1), match.group(2)))
        end = match.end()
        match = _KV_AT.match(line, end) or _KV_START.search(line, end)
    return pairs


def parse_line(line: str) -> tuple[int, float | None, float | None] | None:
    """(iteration, grad_norm, loss) from one log line, or None when it carries no training step."""
    match = _MEGATRON.search(line)
    if match:
        values: dict[str, float] = {}
        for part in match.group(2).split("|"):
            key, sep, value = part.partition(":")
            if sep:
                try:
                    values[_leaf(key.strip())] = _float(value.strip().split()[0])
                except (ValueError, IndexError):
                    continue
        grad = values.get("grad_norm")
        loss = next((values[k] for k in _LOSS_KEYS if k in values), None)
        if loss is None:
            loss = next((v for k, v in values.items() if k.endswith("_loss") and k != "loss_scale"), None)
        return int(match.group(1)), grad, loss
    pairs = [(_leaf(k), v) for k, v in key_values(line)]
    step = next((v for k, v in pairs if k in _STEP_KEYS), None)
    if step is None:
        return None
    try:
        iteration = int(float(step))
    except (ValueError, OverflowError):
        return None
    found = dict(pairs)
    grad = next((found[k] for k in found if k in _GRAD_KEYS or k.endswith("grad_norm")), None)
    loss = next((found[k] for k in _LOSS_KEYS if k in found), None)
    if grad is None and loss is None:
        return None
    return iteration, (_float(grad) if grad is not None else None), (_float(loss) if loss is not None else None)


def error_kind(line: str) -> str | None:
    """The kind of error a log line reports (traceback, exception, error, non_finite), or None."""
    for kind, pattern in _ERRORS:
        if pattern.search(line):
            return kind
    return None


def _leaves(entry: Path, root: Path) -> str:
    """Why `entry`, found under `root`, is not read: a symlink on its way leads out of `root`."""
    return f"leads outside {root} through a symlink (to {resolved_text(entry)}); not followed"


def _log_files(paths: Sequence[str | Path]) -> tuple[list[tuple[Path, Path]], list[dict[str, str]]]:
    """(log file, path relative to the copy dest) for each given file, or each log in a given dir; and the
    entries of given dirs skipped because they lead out of that dir."""
    found: list[tuple[Path, Path]] = []
    skipped: list[dict[str, str]] = []
    for given in paths:
        path = Path(given)
        if path.is_file():
            found.append((Path(os.path.abspath(path)), Path(path.name)))  # named by the caller: read as given
        elif path.is_dir():
            inside, leaving = split_logs(path)
            if not inside and not leaving:
                logs = sorted(p for p in path.rglob("*.log") if p.is_file())
                inside = [p for p in logs if is_inside(p, path)]
                leaving = [p for p in logs if p not in inside]
            skipped += [{"path": str(log), "reason": _leaves(log, path)} for log in leaving]
            if not inside and not leaving:
                raise AxrlError(f"{path}: no *.log files in it or under its logs/")
            found += [(Path(os.path.abspath(log)), Path(path.name) / log.relative_to(path)) for log in inside]
        elif path.is_symlink():
            raise AxrlError(f"{path}: log file or directory not found (a symlink that is broken or a loop)")
        else:
            raise AxrlError(f"{path}: log file or directory not found")
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
                doc = read_untrusted_yaml(config, "run config") or {}
            except AxrlError:
                continue
            section = doc.get("detector") if isinstance(doc, dict) else None
            if isinstance(section, dict):
                keys = ("kind", "window", "threshold", "warmup")
                return {k: section[k] for k in keys if k in section}, str(config)
        break
    return {}, None


def _check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise AxrlError(f"log scan cancelled {where}")


def _copy_file(source: Path, target: Path, cancel: threading.Event | None) -> None:
    """Copy through a temp file renamed over `target`: a symlink at `target` is replaced, never written through."""
    fd, tmp = temp_beside(target)
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as handle:
            while chunk := handle.read(_COPY_CHUNK):
                _check_cancel(cancel, f"while copying {source}")
                out.write(chunk)
        os.replace(tmp, target)  # no fsync: the copy can be made again from the run's logs
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _copy(
    files: list[tuple[Path, Path]], dest: Path, root: Path, cancel: threading.Event | None
) -> tuple[list[Path], list[dict[str, str]]]:
    """Copy each file to `dest`/rel; entries whose folder leads out of `dest` are skipped, with the reason."""
    if not is_inside(dest, root):
        raise AxrlError(
            f"log copy dir {dest} leads outside {root} (to {resolved_text(dest)}) through a symlink; "
            "refusing to write there"
        )
    dest.mkdir(parents=True, exist_ok=True)
    copies: list[Path] = []
    skipped: list[dict[str, str]] = []
    for source, rel in files:
        target = dest / rel
        stem, n = target, 2
        while target in copies:
            target = stem.with_name(f"{stem.stem}-{n}{stem.suffix}")
            n += 1
        if not is_inside(target.parent, dest):
            skipped.append(
                {"path": str(source), "reason": f"its copy's folder {target.parent} leads outside {dest}; not copied"}
            )
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        same = target.is_file() and not target.is_symlink() and target.samefile(source)
        if not same:  # a log already in place (dest holds the originals) is scanned as it is
            _copy_file(source, target, cancel)
        copies.append(target)
    return copies, skipped


def _lines(path: Path, cancel: threading.Event | None) -> Iterator[tuple[int, str, bool]]:
    """(number, text, whole) per line, never holding more than `MAX_LINE_CHARS` of one line.

    A longer line yields only its first `MAX_LINE_CHARS` characters with `whole` False; the rest is read
    past in chunks. Universal newlines, as the text mode of `open` gives them.
    """
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        number = 0
        while line := handle.readline(MAX_LINE_CHARS + 1):
            number += 1
            if number % _CANCEL_EVERY_LINES == 0:
                _check_cancel(cancel, f"in {path.name} at line {number}")
            if len(line) <= MAX_LINE_CHARS or line.endswith("\n"):
                yield number, line, True
                continue
            while (rest := handle.readline(MAX_LINE_CHARS)) and not rest.endswith("\n"):
                _check_cancel(cancel, f"in {path.name} at line {number}")
            yield number, line[:MAX_LINE_CHARS], False


def scan_logs(
    paths: Sequence[str | Path],
    dest: str | Path | None = None,
    *,
    window: int | None = None,
    threshold: float | None = None,
    warmup: int | None = None,
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
    given = {"window": window, "threshold": threshold, "warmup": warmup}
    settings.update({k: v for k, v in given.items() if v is not None})
    try:
        detector = make_detector(
            str(settings["kind"]),
            window=int(settings["window"]),
            threshold=float(settings["threshold"]),
            warmup=int(settings["warmup"]),
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
        copies, not_copied = _copy(files, target, within, cancel)
    except OSError as exc:
        raise AxrlError(f"{exc.filename or target}: cannot copy the logs ({exc.strerror or exc})") from None
    skipped += not_copied

    points: dict[int, dict[str, Any]] = {}
    errors: list[dict[str, Any]] = []
    error_lines = lines = repeated = long_lines = 0
    for done, copy in enumerate(copies, start=1):
        _check_cancel(cancel, f"after {done - 1} of {len(copies)} file(s)")
        if progress is not None:
            progress(f"scanning {copy.name} ({done}/{len(copies)})")
        for number, line, whole in _lines(copy, cancel):
            lines += 1
            if whole:
                parsed = parse_line(line)
                if parsed is not None:
                    iteration, grad, loss = parsed
                    repeated += iteration in points
                    points[iteration] = {"iteration": iteration, "grad_norm": grad, "loss": loss}
            else:
                long_lines += 1  # its numbers could be cut anywhere: not part of the series
            kind = error_kind(line)
            if kind is not None:
                error_lines += 1
                if len(errors) < MAX_ERRORS:
                    errors.append({"file": str(copy), "line": number, "kind": kind, "text": line.strip()[:300]})

    series = [points[i] for i in sorted(points)]
    spikes = []
    for point in series:
        if point["grad_norm"] is None:
            continue
        seen = detector.observe(point["grad_norm"])
        if seen.tripped:
            spikes.append(
                {
                    "iteration": point["iteration"],
                    "grad_norm": seen.grad_norm,
                    "spike_ratio": seen.spike_ratio,
                    "median_norm": None if math.isnan(seen.median_norm) else seen.median_norm,
                }
            )
    return LogScan(
        name=name,
        dest=str(target),
        copied=[str(c) for c in copies],
        series_points=series,
        spikes=spikes,
        errors=errors,
        error_lines=error_lines,
        lines=lines,
        repeated_iterations=repeated,
        detector={**detector.config(), "source": source or "defaults"},
        long_lines=long_lines,
        skipped=skipped[:MAX_SKIPPED],
    )
