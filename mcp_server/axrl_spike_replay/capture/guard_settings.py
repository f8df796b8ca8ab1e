"""The spike guard's settings from environment variables (`AXRL_SPIKE_*`, read by the trainer hooks), never raising,
and the detector every hook's guard runs with (`guard_detector`: armed from step 1, docs/capture.md).

`AXRL_SPIKE_WARMUP_RATIO` (default 10; `off` for a blind warm-up) and `AXRL_SPIKE_MAX_NORM` (default none) arm the
guard during its warm-up, beside `AXRL_SPIKE_WINDOW`, `AXRL_SPIKE_THRESHOLD` and `AXRL_SPIKE_WARMUP`.

A malformed value is reported once, naming the variable and the value, and that one setting takes its default;
the others keep theirs. A typo in one setting should not cost the run its guard: turning the guard off would
lose the very snapshot the hook was set up to take, while the defaults are the documented ones and the report
says which were used. Settings that contradict each other (a warm-up longer than the window) are brought in
line the same way.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from axrl_spike_replay.capture.detectors import DEFAULT_WARMUP_RATIO, MedianRatioDetector
from axrl_spike_replay.capture.spike_guard import RUN_ID_MAX
from axrl_spike_replay.snapshot.layout import is_valid_tag
from axrl_spike_replay.snapshot.metadata import MAX_TEXT_CHARS

DEFAULT_DIR = "checkpoints/spike_snapshots"
DEFAULT_ACTION = "skip"
DEFAULT_WINDOW = 20
DEFAULT_THRESHOLD = 5.0
DEFAULT_WARMUP = 10
DEFAULT_JOB = "verl-job"
OFF = ("off", "none", "blind")  # AXRL_SPIKE_WARMUP_RATIO values that leave the warm-up blind (the old guard)
_Bad = Callable[[str, str, str, object], None]
_D = TypeVar("_D", float, None)


@dataclass(frozen=True)
class GuardSettings:
    """What the guard runs with. `problems`: each malformed setting, its value and what is used instead."""

    snapshots_root: str
    action: str
    window: int
    threshold: float
    warmup: int
    job_name: str
    run_id: str
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # armed from step 1 (capture.detectors): the warm-up's ratio to the steps seen so far (None: a blind warm-up)
    # and an absolute bar until the window has filled (None: none)
    warmup_ratio: float | None = DEFAULT_WARMUP_RATIO
    max_norm: float | None = None


def guard_detector(settings: GuardSettings | None = None) -> MedianRatioDetector:
    """The detector every trainer hook's guard runs with (the verl and Megatron hooks alike): the median-ratio
    detector of `settings` (None: the defaults), armed from step 1 unless its warm-up ratio is off."""
    if settings is None:
        return MedianRatioDetector(window=DEFAULT_WINDOW, threshold=DEFAULT_THRESHOLD, warmup=DEFAULT_WARMUP)
    return MedianRatioDetector(
        window=settings.window,
        threshold=settings.threshold,
        warmup=settings.warmup,
        warmup_ratio=settings.warmup_ratio,
        max_norm=settings.max_norm,
    )


def new_run_id() -> str:
    """A run id for snapshot names: the UTC start time and four hex digits (`20250102T030405Z-9f3a`)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)


def settings_from_env(env: Mapping[str, str], actions: Mapping[str, str]) -> GuardSettings:
    """The guard's settings from `env`. `actions` maps each accepted `AXRL_SPIKE_ACTION` value to the action run
    (a trainer that owns its checkpoints maps `rollback` to `skip`)."""
    problems: list[str] = []
    notes: list[str] = []

    def bad(name: str, value: str, rule: str, default: object) -> None:
        problems.append(f"{name}={value!r} is not {rule}; using the default {default}")

    raw_action = env.get("AXRL_SPIKE_ACTION", DEFAULT_ACTION).strip()
    action = actions.get(raw_action)
    if action is None:
        bad("AXRL_SPIKE_ACTION", raw_action, f"one of {' | '.join(actions)}", DEFAULT_ACTION)
        action = DEFAULT_ACTION
    elif action != raw_action:
        notes.append(f"AXRL_SPIKE_ACTION={raw_action}: a tripped guard skips the step ({action})")

    window = _integer(env, "AXRL_SPIKE_WINDOW", DEFAULT_WINDOW, 2, bad)
    threshold = _positive(env, "AXRL_SPIKE_THRESHOLD", DEFAULT_THRESHOLD, bad)
    warmup = _integer(env, "AXRL_SPIKE_WARMUP", DEFAULT_WARMUP, 1, bad)
    if warmup > window:
        problems.append(f"AXRL_SPIKE_WARMUP={warmup} is longer than the window ({window}); using {window}")
        warmup = window
    warmup_ratio: float | None = DEFAULT_WARMUP_RATIO
    raw_ratio = env.get("AXRL_SPIKE_WARMUP_RATIO")
    if raw_ratio is not None and raw_ratio.strip().lower() in OFF:
        warmup_ratio = None
        notes.append(f"AXRL_SPIKE_WARMUP_RATIO={raw_ratio.strip()}: the warm-up is blind (only non-finite norms trip)")
    elif raw_ratio is not None:
        warmup_ratio = _positive(env, "AXRL_SPIKE_WARMUP_RATIO", DEFAULT_WARMUP_RATIO, bad, above=1.0)
    max_norm = _positive(env, "AXRL_SPIKE_MAX_NORM", None, bad) if env.get("AXRL_SPIKE_MAX_NORM") else None

    root = env.get("AXRL_SPIKE_DIR", "").strip() or DEFAULT_DIR
    job = env.get("AXRL_JOB_NAME", DEFAULT_JOB)
    if not job.strip() or len(job) > MAX_TEXT_CHARS:
        bad("AXRL_JOB_NAME", job[:80], f"a name of 1-{MAX_TEXT_CHARS} characters", DEFAULT_JOB)
        job = DEFAULT_JOB
    run_id = env.get("AXRL_RUN_ID", "").strip()
    if run_id and (len(run_id) > RUN_ID_MAX or not is_valid_tag(run_id)):
        generated = new_run_id()
        rule = f"1-{RUN_ID_MAX} letters, digits, '.', '_' or '-' (starting with a letter or digit)"
        problems.append(f"AXRL_RUN_ID={run_id[:80]!r} is not {rule}; using {generated}")
        run_id = generated
    return GuardSettings(
        snapshots_root=root,
        action=action,
        window=window,
        threshold=threshold,
        warmup=warmup,
        job_name=job,
        run_id=run_id or new_run_id(),
        problems=tuple(problems),
        notes=tuple(notes),
        warmup_ratio=warmup_ratio,
        max_norm=max_norm,
    )


def _integer(env: Mapping[str, str], name: str, default: int, minimum: int, bad: _Bad) -> int:
    value = env.get(name)
    if value is None:
        return default
    try:
        number = int(value.strip())
    except ValueError:
        number = None
    if number is None or number < minimum:
        bad(name, value, f"an integer >= {minimum}", default)
        return default
    return number


def _positive(env: Mapping[str, str], name: str, default: _D, bad: _Bad, above: float = 0.0) -> float | _D:
    value = env.get(name)
    if value is None:
        return default
    try:
        number = float(value.strip())
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number <= above:
        bad(name, value, f"a finite number > {above:g}", default)
        return default
    return number
