"""Detectors on the pre-clip grad norm: rolling-median ratio (default) and z-score over a window."""

from __future__ import annotations

import math
import random

import pytest

from axrl_spike_replay.capture.detectors import MedianRatioDetector, ZScoreDetector, make_detector
from axrl_spike_replay.errors import ConfigError


def _norms(n: int, burst: dict[int, float], seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [burst.get(i, 1.0 + 0.2 * rng.random()) for i in range(1, n + 1)]


@pytest.mark.parametrize("detector", [MedianRatioDetector(window=10, threshold=5.0, warmup=8), ZScoreDetector()])
def test_trips_exactly_on_the_burst(detector) -> None:
    norms = _norms(40, {20: 30.0, 21: 80.0, 22: 12.0})
    tripped = [step for step, g in enumerate(norms, start=1) if detector.observe(g).tripped]
    assert tripped == [20, 21, 22]


def test_spikes_do_not_enter_the_window_so_a_long_burst_keeps_tripping() -> None:
    detector = MedianRatioDetector(window=4, threshold=3.0, warmup=4)
    for _ in range(4):
        detector.observe(1.0)
    seen = [detector.observe(10.0) for _ in range(10)]
    assert all(d.tripped for d in seen)
    assert all(d.median_norm == 1.0 and d.spike_ratio == 10.0 for d in seen)


def test_nothing_trips_during_warm_up_except_a_non_finite_norm() -> None:
    detector = MedianRatioDetector(window=10, threshold=2.0, warmup=5)
    first = [detector.observe(g) for g in (1.0, 50.0, 1.0)]
    assert [d.warming_up for d in first] == [True, True, True] and not any(d.tripped for d in first)
    nan = detector.observe(math.nan)
    assert nan.tripped and nan.spike_ratio == math.inf
    assert detector.observe(math.inf).tripped
    assert len(detector.history) == 3  # neither entered the window


def test_the_ratio_is_against_the_rolling_median() -> None:
    detector = MedianRatioDetector(window=3, threshold=5.0, warmup=3)
    for g in (1.0, 2.0, 3.0, 4.0):  # window keeps the newest three: 2, 3, 4
        detector.observe(g)
    seen = detector.observe(15.0)
    assert seen.median_norm == 3.0 and seen.spike_ratio == 5.0 and not seen.tripped  # at the bar: healthy
    after = detector.observe(20.1)  # the window is now 3, 4, 15
    assert after.median_norm == 4.0 and after.tripped


def test_state_round_trips_so_a_resumed_run_keeps_its_window() -> None:
    detector = MedianRatioDetector(window=5, threshold=4.0, warmup=3)
    for g in (1.0, 1.1, 0.9):
        detector.observe(g)
    resumed = MedianRatioDetector(window=5, threshold=4.0, warmup=3)
    resumed.load_state_dict(detector.state_dict())
    assert resumed.observe(5.0).tripped


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 1}, "window must be an integer >= 2"),
        ({"window": 5, "warmup": 6}, r"warmup must be an integer in \[1, window=5\]"),
        ({"threshold": 0.5}, "threshold must be > 1"),
        ({"threshold": math.nan}, "threshold must be a finite number"),
    ],
)
def test_bad_settings_are_refused_with_the_setting_named(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        MedianRatioDetector(**kwargs)


def test_detectors_by_kind() -> None:
    assert make_detector("zscore", window=8, threshold=4.0, warmup=4).config() == {
        "kind": "zscore",
        "window": 8,
        "threshold": 4.0,
        "warmup": 4,
    }
    with pytest.raises(ConfigError, match="detector kind"):
        make_detector("ewma")
