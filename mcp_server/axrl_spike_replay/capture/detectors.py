"""Spike detectors on the pre-clip global grad norm: ratio to the rolling median, or z-score over a window.

A detector keeps a window of healthy norms; spikes never enter it, so a burst cannot raise its own bar. It judges
by its own statistic once `warmup` healthy norms are in the window. Before that it is armed from step 1 by default:

- a non-finite norm always trips;
- `warmup_ratio` R (default DEFAULT_WARMUP_RATIO): during the warm-up, a norm more than R times the median of the
  norms seen so far trips (from the second step on). Every finite norm of the warm-up counts, a tripped one too: a
  run whose norms settle at another level in its first steps is taken at that level once it is the more common one,
  instead of tripping on every later step. None: the warm-up is blind (only non-finite norms trip there);
- `max_norm` M (default none: a run's scale is not known in advance): until the window has filled, a norm above M
  trips whatever the others are.

What arming costs in false trips on a run's first steps, and what it catches there, is measured by
benchmarks/bench_guard_warmup.py (docs/capture.md gives the figures).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.snapshot.metadata import DetectorSpec

DEFAULT_WARMUP_RATIO = 10.0  # in the warm-up, a norm this many times the median of the norms seen so far trips
RULES = ("non_finite", "max_norm", "warmup_ratio", "detector")  # which rule tripped (`Detection.rule`)


@dataclass(frozen=True)
class Detection:
    """What a detector saw for one grad norm."""

    grad_norm: float
    median_norm: float  # median of the healthy window (nan while empty); in the warm-up, of the norms seen so far
    spike_ratio: float  # grad_norm / median_norm
    score: float  # the statistic that judged it: the ratio, the z-score, or grad_norm / max_norm
    tripped: bool
    warming_up: bool
    rule: str = ""  # the rule that tripped (one of RULES); "" when none did


class Detector(Protocol):
    kind: str
    window: int
    threshold: float
    warmup: int

    def observe(self, grad_norm: float) -> Detection: ...

    def spec(self) -> DetectorSpec: ...

    def config(self) -> dict[str, Any]: ...

    @property
    def settled(self) -> bool: ...


def check_warmup_guard(warmup_ratio: float | None, max_norm: float | None) -> None:
    """ConfigError unless `warmup_ratio` is None or a finite number > 1, and `max_norm` None or a finite number > 0."""
    for name, value, low in (("warmup_ratio", warmup_ratio, 1.0), ("max_norm", max_norm, 0.0)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= low:
            raise ConfigError(f"detector {name} must be a finite number > {low:g} (or none), got {value!r}")


class _WindowDetector:
    kind = "base"

    def __init__(
        self,
        window: int,
        threshold: float,
        warmup: int,
        warmup_ratio: float | None = DEFAULT_WARMUP_RATIO,
        max_norm: float | None = None,
    ) -> None:
        if not isinstance(window, int) or window < 2:
            raise ConfigError(f"detector window must be an integer >= 2, got {window!r}")
        if not isinstance(warmup, int) or not 1 <= warmup <= window:
            raise ConfigError(f"detector warmup must be an integer in [1, window={window}], got {warmup!r}")
        if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold <= 0:
            raise ConfigError(f"detector threshold must be a finite number > 0, got {threshold!r}")
        check_warmup_guard(warmup_ratio, max_norm)
        self.window = window
        self.threshold = float(threshold)
        self.warmup = warmup
        self.warmup_ratio = float(warmup_ratio) if warmup_ratio is not None else None
        self.max_norm = float(max_norm) if max_norm is not None else None
        self.history: deque[float] = deque(maxlen=window)
        self.seen: deque[float] = deque(maxlen=window)  # the warm-up's finite norms, tripped ones too

    def _score(self, grad_norm: float, median: float) -> float:
        raise NotImplementedError

    @property
    def settled(self) -> bool:
        """Whether only the detector's own statistic judges from now on (a non-finite norm aside): the warm-up is
        over and, with a `max_norm`, the window has filled."""
        return len(self.history) >= self.warmup and (self.max_norm is None or len(self.history) >= self.window)

    def observe(self, grad_norm: float) -> Detection:
        """Judge `grad_norm` against the window (in the warm-up: against the norms seen so far); healthy norms then
        join the window."""
        value = float(grad_norm)
        median = statistics.median(self.history) if self.history else math.nan
        ratio = value / median if median and math.isfinite(median) and median > 0 else math.inf
        warming_up = len(self.history) < self.warmup
        if not math.isfinite(value):
            detection = Detection(value, median, math.inf, math.inf, True, warming_up, "non_finite")
        elif self.max_norm is not None and len(self.history) < self.window and value > self.max_norm:
            detection = Detection(value, median, ratio, value / self.max_norm, True, warming_up, "max_norm")
        elif warming_up:
            detection = self._early(value)
        else:
            score = self._score(value, median)
            tripped = score > self.threshold
            detection = Detection(value, median, ratio, score, tripped, False, "detector" if tripped else "")
        if warming_up and math.isfinite(value):
            self.seen.append(value)
        if not detection.tripped:
            self.history.append(value)
        return detection

    def _early(self, value: float) -> Detection:
        """A finite norm in the warm-up, against the median of the norms seen so far (`warmup_ratio`)."""
        reference = statistics.median(self.seen) if self.seen else math.nan
        if self.warmup_ratio is None or not reference > 0:  # blind, nothing seen yet, or no scale to judge by
            return Detection(value, reference, math.nan, math.nan, tripped=False, warming_up=True)
        ratio = value / reference
        tripped = ratio > self.warmup_ratio
        return Detection(value, reference, ratio, ratio, tripped, True, "warmup_ratio" if tripped else "")

    def spec(self) -> DetectorSpec:
        """The `detector` block of a snapshot's metadata."""
        return DetectorSpec(kind=self.kind, window=self.window, threshold=self.threshold)

    def config(self) -> dict[str, Any]:
        """The `detector:` section of a run config."""
        return {
            "kind": self.kind,
            "window": self.window,
            "threshold": self.threshold,
            "warmup": self.warmup,
            "warmup_ratio": self.warmup_ratio,
            "max_norm": self.max_norm,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(x) for x in state["history"]), maxlen=self.window)
        self.seen = deque((float(x) for x in state.get("seen", ())), maxlen=self.window)


class MedianRatioDetector(_WindowDetector):
    """Trips when grad_norm / median(window) exceeds `threshold` (default detector)."""

    kind = "median_ratio"

    def __init__(
        self,
        window: int = 20,
        threshold: float = 5.0,
        warmup: int = 10,
        warmup_ratio: float | None = DEFAULT_WARMUP_RATIO,
        max_norm: float | None = None,
    ) -> None:
        super().__init__(window, threshold, warmup, warmup_ratio, max_norm)
        if self.threshold <= 1:
            raise ConfigError(f"median_ratio detector threshold must be > 1, got {threshold!r}")

    def _score(self, grad_norm: float, median: float) -> float:
        return grad_norm / median if median > 0 else math.inf


class ZScoreDetector(_WindowDetector):
    """Trips when (grad_norm - mean) / std over the window exceeds `threshold`."""

    kind = "zscore"

    def __init__(
        self,
        window: int = 20,
        threshold: float = 6.0,
        warmup: int = 10,
        min_std: float = 1e-12,
        warmup_ratio: float | None = DEFAULT_WARMUP_RATIO,
        max_norm: float | None = None,
    ) -> None:
        super().__init__(window, threshold, warmup, warmup_ratio, max_norm)
        if warmup < 2:
            raise ConfigError(f"zscore detector warmup must be >= 2 (a std needs two norms), got {warmup!r}")
        self.min_std = float(min_std)

    def _score(self, grad_norm: float, median: float) -> float:
        mean = statistics.fmean(self.history)
        std = max(statistics.pstdev(self.history), self.min_std, 1e-3 * abs(mean))
        return (grad_norm - mean) / std


def make_detector(
    kind: str = "median_ratio",
    *,
    window: int = 20,
    threshold: float = 5.0,
    warmup: int = 10,
    warmup_ratio: float | None = DEFAULT_WARMUP_RATIO,
    max_norm: float | None = None,
) -> MedianRatioDetector | ZScoreDetector:
    """A detector by kind name (`median_ratio` or `zscore`), armed from step 1 unless `warmup_ratio` is None."""
    if kind == "median_ratio":
        return MedianRatioDetector(window, threshold, warmup, warmup_ratio=warmup_ratio, max_norm=max_norm)
    if kind == "zscore":
        return ZScoreDetector(window, threshold, warmup, warmup_ratio=warmup_ratio, max_norm=max_norm)
    raise ConfigError(f"detector kind must be 'median_ratio' or 'zscore', got {kind!r}")
