"""Young-Daly: how often to checkpoint when spikes force rollbacks."""

from __future__ import annotations

import math

import pytest

from axrl_spike_replay.capture.checkpoint_interval import checkpoint_interval, expected_overhead
from axrl_spike_replay.errors import ConfigError


def test_twenty_second_checkpoints_a_spike_every_2000_one_second_steps() -> None:
    advice = checkpoint_interval(20, 2000, 1.0)
    assert advice.optimal_interval_steps == 283
    assert advice.optimal_interval_exact == pytest.approx(math.sqrt(80_000))
    assert [o.interval_steps for o in advice.options] == [71, 141, 283, 566, 1131]
    best = min(advice.options, key=lambda o: o.total_overhead)
    assert best.interval_steps == 283 and best.total_overhead == advice.optimal_overhead
    at_optimum = advice.options[2]
    assert at_optimum.checkpoint_overhead == pytest.approx(at_optimum.expected_rework, rel=1e-2)  # balanced at K*
    assert advice.optimal_overhead == pytest.approx(20 / 283 + 283 / 4000)


def test_the_overhead_is_convex_around_the_optimum() -> None:
    totals = [expected_overhead(k, 20, 2000, 1.0) for k in (100, 200, 283, 400, 800)]
    assert totals[2] == min(totals)


def test_a_tiny_optimum_is_at_least_one_step() -> None:
    assert checkpoint_interval(0.001, 1, 100).optimal_interval_steps == 1


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan])
def test_bad_values_name_the_argument(bad) -> None:
    with pytest.raises(ConfigError, match="checkpoint_cost_s must be a finite number > 0"):
        checkpoint_interval(bad, 2000, 1)
    with pytest.raises(ConfigError, match="step_time_s"):
        checkpoint_interval(20, 2000, bad)


@pytest.mark.parametrize(
    ("cost", "mtbf", "step"),
    [(1e200, 1e200, 1), (1, 1e308, 1e-308), (1e300, 1, 1e-300), (1e308, 1e308, 1e-308)],
)
def test_inputs_whose_interval_or_overhead_overflows_are_a_clear_error(cost: float, mtbf: float, step: float) -> None:
    with pytest.raises(ConfigError, match="out of range: the interval K\\* = sqrt"):
        checkpoint_interval(cost, mtbf, step)


@pytest.mark.parametrize(
    "argv",
    [
        ["1e200", "1e200", "1"],
        ["inf", "2000", "1"],
        ["nan", "2000", "1"],
        ["-1", "2000", "1"],
        ["20", "2000", "-inf"],
    ],
)
def test_the_command_answers_absurd_inputs_with_an_error_not_a_traceback(argv: list[str], capsys) -> None:
    from axrl_spike_replay.cli import main

    cost, mtbf, step = argv
    status = main(["checkpoint-interval", f"--checkpoint-cost={cost}", f"--mtbf-steps={mtbf}", f"--step-time={step}"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("axrl-spike-replay checkpoint-interval: error: ") and "Traceback" not in err


def test_extreme_but_finite_inputs_print_short_figures(capsys) -> None:
    from axrl_spike_replay.cli import main

    status = main(
        ["checkpoint-interval", "--checkpoint-cost", "1e-300", "--mtbf-steps", "1e300", "--step-time", "1e-300"]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "1.41e+150" in out and max(len(line) for line in out.splitlines()) < 200
