"""Copy a job's training logs into the workspace and scan them: grad-norm/loss series, spikes, error lines.

Understood line formats (both streamed line by line, so logs of any size are fine):
- Megatron-style: `iteration 12/ 1000 | ... | lm loss: 1.2E+00 | ... | grad norm: 3.4 | ...`
- key=value (or key:value): `step=12 grad_norm=3.4 loss=0.1`, `step:12 - actor/grad_norm:3.4 - actor/pg_loss:0.1`

Spikes are found by the spike guard's own detector (`capture.detectors`, ratio to the rolling
median of healthy norms by default), with the run's own detector settings where its snapshots
hold them, run over the series in iteration order.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from axrl_spike_replay.capture.detectors import make_detector
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.snapshot.discovery import find_logs
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, RUN_CONFIG, SNAPSHOTS_DIR, parse_output_dir_name

MAX_ERRORS = 200
_DEFAULT_DETECTOR: dict[str, Any] = {"kind": "median_ratio", "window": 20, "threshold": 5.0, "warmup": 10}
_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf(?:inity)?)"
_MEGATRON = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|(.*)", re.IGNORECASE)
_KV = re.compile(rf"([A-Za-z_][\w./-]*)\s*[=:]\s*({_NUM})(?![\w.])", re.IGNORECASE)
_STEP_KEYS = {"step", "iteration", "iter", "global_step", "it"}
_GRAD_KEYS = {"grad_norm", "gradnorm", "grad_norm_pre_clip", "global_grad_norm", "total_grad_norm"}
_LOSS_KEYS = ("lm_loss", "loss", "total_loss", "train_loss", "policy_loss", "pg_loss")
_ERRORS = (
    ("traceback", re.compile(r"Traceback \(most recent call last\)")),
    ("exception", re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b(?::|\s*$)")),
    ("error", re.compile(r"\b(?:ERROR|FATAL|CRITICAL)\b|CUDA out of memory|NCCL (?:error|timeout)", re.IGNORECASE)),
    ("non_finite", re.compile(r"[:=]\s*[-+]?(?:nan|inf(?:inity)?)\b", re.IGNORECASE)),
)


@dataclass
class LogScan:
    """What `logs` reports. `series_points` is one point per iteration (the last logged value wins)."""

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


def _leaf(key: str) -> str:
    return key.rsplit("/", 1)[-1].lower().replace("-", "_").replace(" ", "_")


def _float(text: str) -> float:
    return float(text)


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
    pairs = [(_leaf(k), v) for k, v in _KV.findall(line)]
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


def _log_files(paths: Sequence[str | Path]) -> list[tuple[Path, Path]]:
    """(log file, path relative to the copy dest) for each given file, or each log in a given dir."""
    found: list[tuple[Path, Path]] = []
    for given in paths:
        path = Path(given)
        if path.is_file():
            found.append((Path(os.path.abspath(path)), Path(path.name)))
        elif path.is_dir():
            logs = find_logs(path) or sorted(p for p in path.rglob("*.log") if p.is_file())
            if not logs:
                raise AxrlError(f"{path}: no *.log files in it or under its logs/")
            found += [(Path(os.path.abspath(log)), Path(path.name) / log.relative_to(path)) for log in logs]
        else:
            raise AxrlError(f"{path}: log file or directory not found")
    return found


def default_name(paths: Sequence[str | Path]) -> str:
    """The job name of the first path's output dir (`<run>~<job>__<role>`), else its name."""
    first = Path(paths[0]).resolve()
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
            try:
                doc = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
            except (OSError, yaml.YAMLError):
                continue
            section = doc.get("detector") if isinstance(doc, dict) else None
            if isinstance(section, dict):
                keys = ("kind", "window", "threshold", "warmup")
                return {k: section[k] for k in keys if k in section}, str(config)
        break
    return {}, None


def _copy(files: list[tuple[Path, Path]], dest: Path) -> list[Path]:
    copies: list[Path] = []
    for source, rel in files:
        target = dest / rel
        stem, n = target, 2
        while target in copies:
            target = stem.with_name(f"{stem.stem}-{n}{stem.suffix}")
            n += 1
        target.parent.mkdir(parents=True, exist_ok=True)
        if not (target.exists() and target.samefile(source)):
            shutil.copyfile(source, target)  # streams in chunks
        copies.append(target)
    return copies


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        yield from enumerate(handle, start=1)


def scan_logs(
    paths: Sequence[str | Path],
    dest: str | Path | None = None,
    *,
    window: int | None = None,
    threshold: float | None = None,
    warmup: int | None = None,
    progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
) -> LogScan:
    """Copy logs (files, or dirs holding `*.log` / `logs/*.log`) to `dest` and scan the copies.

    `progress` receives a line per log file scanned; setting `cancel` stops between files (AxrlError).
    `dest` defaults to `./tmp/spike-replay/<job or name>/logs` in the current workspace. Detector
    settings not given come from the run's own config (the `detector:` section of the newest
    snapshot's `run_config.yaml` in the logs' output dir), else the guard's defaults.
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
        raise ConfigError(f"detector settings {settings} are not valid ({exc})") from None
    files = _log_files(paths)
    name = default_name(paths)
    target = Path(os.path.abspath(dest)) if dest is not None else Path.cwd() / "tmp" / "spike-replay" / name / "logs"
    try:
        copies = _copy(files, target)
    except OSError as exc:
        raise AxrlError(f"{exc.filename or target}: cannot copy the logs ({exc.strerror or exc})") from None

    points: dict[int, dict[str, Any]] = {}
    errors: list[dict[str, Any]] = []
    error_lines = lines = repeated = 0
    for done, copy in enumerate(copies, start=1):
        if cancel is not None and cancel.is_set():
            raise AxrlError(f"log scan cancelled after {done - 1} of {len(copies)} file(s)")
        if progress is not None:
            progress(f"scanning {copy.name} ({done}/{len(copies)})")
        for number, line in _lines(copy):
            lines += 1
            parsed = parse_line(line)
            if parsed is not None:
                iteration, grad, loss = parsed
                repeated += iteration in points
                points[iteration] = {"iteration": iteration, "grad_norm": grad, "loss": loss}
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
    )
