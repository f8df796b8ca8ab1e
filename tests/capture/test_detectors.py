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


def test_a_blind_warm_up_trips_on_a_non_finite_norm_only() -> None:
    detector = MedianRatioDetector(window=10, threshold=2.0, warmup=5, warmup_ratio=None)
    first = [detector.observe(g) for g in (1.0, 50.0, 1.0)]
    assert [d.warming_up for d in first] == [True, True, True] and not any(d.tripped for d in first)
    nan = detector.observe(math.nan)
    assert nan.tripped and nan.spike_ratio == math.inf and nan.rule == "non_finite"
    assert detector.observe(math.inf).tripped
    assert len(detector.history) == 3  # neither entered the window


@pytest.mark.parametrize("kind", ["median_ratio", "zscore"])
def test_the_default_guard_is_armed_from_step_1(kind: str) -> None:
    """A step at 35x the median passed unflagged inside an 8-step warm-up: armed, it trips, against the median of
    the steps seen so far; the steps around it do not."""
    detector = make_detector(kind, window=20, threshold=5.0, warmup=8)
    seen = [detector.observe(g) for g in (0.9, 1.1, 1.0, 35.0, 1.05, math.nan, 0.95)]
    assert [d.tripped for d in seen] == [False, False, False, True, False, True, False]
    assert all(d.warming_up for d in seen)
    spike = seen[3]
    assert spike.rule == "warmup_ratio" and spike.median_norm == 1.0 and spike.spike_ratio == 35.0
    assert seen[0].median_norm != seen[0].median_norm  # step 1: nothing seen yet, nothing but non-finite can trip
    assert list(detector.history) == [0.9, 1.1, 1.0, 1.05, 0.95]  # the spike did not enter the window


def test_a_run_that_settles_at_another_level_trips_once_not_on_every_step() -> None:
    """The warm-up's reference counts every finite norm seen, tripped ones too: a first step far below the rest is
    outvoted after one trip, instead of the guard tripping on every later step."""
    detector = MedianRatioDetector(window=10, threshold=5.0, warmup=5)
    seen = [detector.observe(g) for g in (0.01, 1.0, 1.1, 0.9, 1.0, 1.2, 1.0)]
    assert [d.tripped for d in seen] == [False, True, False, False, False, False, False]
    assert not detector.observe(0.0).tripped and not MedianRatioDetector().observe(0.0).tripped  # no scale: no trip


def test_an_absolute_bar_holds_until_the_window_has_filled() -> None:
    detector = MedianRatioDetector(window=4, threshold=10.0, warmup=2, warmup_ratio=None, max_norm=5.0)
    seen = [detector.observe(g) for g in (1.0, 6.0, 1.0, 1.0, 6.0, 1.0)]
    assert [d.tripped for d in seen] == [False, True, False, False, True, False]
    assert seen[1].rule == "max_norm" and seen[1].score == 6.0 / 5.0 and seen[4].rule == "max_norm"
    assert not seen[4].warming_up  # past the warm-up, the window not full yet: the bar still holds
    assert detector.settled and not detector.observe(6.0).tripped  # window full: the median ratio alone (6x < 10x)


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
    early = MedianRatioDetector(window=5, threshold=4.0, warmup=4)
    for g in (1.0, 30.0):
        early.observe(g)
    again = MedianRatioDetector(window=5, threshold=4.0, warmup=4)
    again.load_state_dict(early.state_dict())
    assert list(again.seen) == [1.0, 30.0] and list(again.history) == [1.0]
    assert again.observe(200.0).tripped  # 200 / median(1, 30): the warm-up's reference came back with the window
    older = MedianRatioDetector(window=5, threshold=4.0, warmup=4)
    older.load_state_dict({"history": [1.0]})  # a state saved before the warm-up was armed: nothing seen yet
    assert not older.observe(200.0).tripped


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 1}, "window must be an integer >= 2"),
        ({"window": 5, "warmup": 6}, r"warmup must be an integer in \[1, window=5\]"),
        ({"threshold": 0.5}, "threshold must be > 1"),
        ({"threshold": math.nan}, "threshold must be a finite number"),
        ({"warmup_ratio": 1.0}, "warmup_ratio must be a finite number > 1"),
        ({"warmup_ratio": math.inf}, "warmup_ratio must be a finite number > 1"),
        ({"max_norm": 0.0}, "max_norm must be a finite number > 0"),
        ({"max_norm": math.nan}, "max_norm must be a finite number > 0"),
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
        "warmup_ratio": 10.0,
        "max_norm": None,
    }
    assert make_detector(warmup_ratio=None, max_norm=3.0).config()["warmup_ratio"] is None
    with pytest.raises(ConfigError, match="detector kind"):
        make_detector("ewma")
