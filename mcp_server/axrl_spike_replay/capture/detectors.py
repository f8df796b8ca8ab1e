"""Spike detectors on the pre-clip global grad norm: ratio to the rolling median, or z-score over a window.

A detector keeps a window of healthy norms; spikes never enter it, so a burst cannot raise its own
bar. Nothing trips during warm-up except a non-finite norm, which always trips.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.snapshot.metadata import DetectorSpec


@dataclass(frozen=True)
class Detection:
    """What a detector saw for one grad norm."""

    grad_norm: float
    median_norm: float  # median of the healthy window (nan while it is empty)
    spike_ratio: float  # grad_norm / median_norm
    score: float  # the detector's own statistic: the ratio, or the z-score
    tripped: bool
    warming_up: bool


class Detector(Protocol):
    kind: str
    window: int
    threshold: float
    warmup: int

    def observe(self, grad_norm: float) -> Detection: ...

    def spec(self) -> DetectorSpec: ...


class _WindowDetector:
    kind = "base"

    def __init__(self, window: int, threshold: float, warmup: int) -> None:
        if not isinstance(window, int) or window < 2:
            raise ConfigError(f"detector window must be an integer >= 2, got {window!r}")
        if not isinstance(warmup, int) or not 1 <= warmup <= window:
            raise ConfigError(f"detector warmup must be an integer in [1, window={window}], got {warmup!r}")
        if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold <= 0:
            raise ConfigError(f"detector threshold must be a finite number > 0, got {threshold!r}")
        self.window = window
        self.threshold = float(threshold)
        self.warmup = warmup
        self.history: deque[float] = deque(maxlen=window)

    def _score(self, grad_norm: float, median: float) -> float:
        raise NotImplementedError

    def observe(self, grad_norm: float) -> Detection:
        """Judge `grad_norm` against the window; healthy norms then join the window."""
        value = float(grad_norm)
        median = statistics.median(self.history) if self.history else math.nan
        ratio = value / median if median and math.isfinite(median) and median > 0 else math.inf
        warming_up = len(self.history) < self.warmup
        if not math.isfinite(value):
            detection = Detection(value, median, math.inf, math.inf, tripped=True, warming_up=warming_up)
        elif warming_up:
            detection = Detection(value, median, ratio, math.nan, tripped=False, warming_up=True)
        else:
            score = self._score(value, median)
            detection = Detection(value, median, ratio, score, tripped=score > self.threshold, warming_up=False)
        if not detection.tripped:
            self.history.append(value)
        return detection

    def spec(self) -> DetectorSpec:
        """The `detector` block of a snapshot's metadata."""
        return DetectorSpec(kind=self.kind, window=self.window, threshold=self.threshold)

    def config(self) -> dict[str, Any]:
        """The `detector:` section of a run config."""
        return {"kind": self.kind, "window": self.window, "threshold": self.threshold, "warmup": self.warmup}

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(x) for x in state["history"]), maxlen=self.window)


class MedianRatioDetector(_WindowDetector):
    """Trips when grad_norm / median(window) exceeds `threshold` (default detector)."""

    kind = "median_ratio"

    def __init__(self, window: int = 20, threshold: float = 5.0, warmup: int = 10) -> None:
        super().__init__(window, threshold, warmup)
        if self.threshold <= 1:
            raise ConfigError(f"median_ratio detector threshold must be > 1, got {threshold!r}")

    def _score(self, grad_norm: float, median: float) -> float:
        return grad_norm / median if median > 0 else math.inf


class ZScoreDetector(_WindowDetector):
    """Trips when (grad_norm - mean) / std over the window exceeds `threshold`."""

    kind = "zscore"

    def __init__(self, window: int = 20, threshold: float = 6.0, warmup: int = 10, min_std: float = 1e-12) -> None:
        super().__init__(window, threshold, warmup)
        if warmup < 2:
            raise ConfigError(f"zscore detector warmup must be >= 2 (a std needs two norms), got {warmup!r}")
        self.min_std = float(min_std)

    def _score(self, grad_norm: float, median: float) -> float:
        mean = statistics.fmean(self.history)
        std = max(statistics.pstdev(self.history), self.min_std, 1e-3 * abs(mean))
        return (grad_norm - mean) / std


def make_detector(
    kind: str = "median_ratio", *, window: int = 20, threshold: float = 5.0, warmup: int = 10
) -> MedianRatioDetector | ZScoreDetector:
    """A detector by kind name (`median_ratio` or `zscore`)."""
    if kind == "median_ratio":
        return MedianRatioDetector(window=window, threshold=threshold, warmup=warmup)
    if kind == "zscore":
        return ZScoreDetector(window=window, threshold=threshold, warmup=warmup)
    raise ConfigError(f"detector kind must be 'median_ratio' or 'zscore', got {kind!r}")
