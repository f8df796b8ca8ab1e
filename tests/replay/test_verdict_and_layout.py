"""Verdicts and replay layouts, from their definitions."""

from __future__ import annotations

import math

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.replay.layout_plan import plan_layout
from axrl_spike_replay.replay.verdict import (
    baseline_verdict,
    mitigation_verdict,
    ratio_threshold,
    tolerance,
)
from axrl_spike_replay.snapshot.metadata import DetectorSpec


def test_baseline_is_reproduced_within_the_layouts_tolerance() -> None:
    assert tolerance("full") == 1e-6 and tolerance("reduced") == 1e-5
    assert tolerance("full", "cuda") > tolerance("reduced")
    assert baseline_verdict(10.0 * (1 + 9e-7), 10.0, tolerance("full")) == "reproduced"
    assert baseline_verdict(10.0 * (1 + 2e-6), 10.0, tolerance("full")) == "not_reproduced"
    assert baseline_verdict(10.0 * (1 + 2e-6), 10.0, tolerance("reduced")) == "reproduced"
    assert baseline_verdict(math.inf, math.inf, 1e-6) == "reproduced"
    assert baseline_verdict(math.nan, 10.0, 1e-6) == "not_reproduced"


@pytest.mark.parametrize(
    ("grad_norm", "verdict"),
    [
        (4.9, "cleared"),  # ratio 4.9 < threshold 5 (median 1)
        (5.0, "partial"),  # at the threshold, half the baseline's 10
        (7.0, "no_effect"),
        (10.4, "no_effect"),
        (11.0, "worse"),
        (math.inf, "worse"),
    ],
)
def test_mitigation_verdict_against_the_baseline(grad_norm: float, verdict: str) -> None:
    assert mitigation_verdict(grad_norm, baseline_grad_norm=10.0, median_norm=1.0, threshold=5.0) == verdict


def test_threshold_comes_from_a_median_ratio_detector() -> None:
    assert ratio_threshold(DetectorSpec(kind="median_ratio", threshold=3.0)) == 3.0
    assert ratio_threshold(DetectorSpec(kind="zscore", threshold=6.0)) == 5.0


def test_layouts_full_reduced_and_uneven() -> None:
    full = plan_layout(4)
    assert full.fidelity == "full" and full.assignment == ((0,), (1,), (2,), (3,))
    reduced = plan_layout(4, 1)
    assert reduced.fidelity == "reduced" and reduced.assignment == ((0, 1, 2, 3),)
    assert plan_layout(3, 2).assignment == ((0,), (1, 2))
    with pytest.raises(ConfigError, match="larger than the saved world size 2"):
        plan_layout(2, 3)
    with pytest.raises(ConfigError, match=">= 1"):
        plan_layout(2, 0)
