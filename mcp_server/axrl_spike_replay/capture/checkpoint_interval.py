"""Young-Daly checkpoint interval: how often to checkpoint when spikes force rollbacks.

With a checkpoint costing C seconds, a spike every M steps on average and T seconds per step, the
fraction of time lost with an interval of K steps is about C / (K·T) (writing checkpoints) plus
K / (2·M) (re-doing, on average, half an interval after each rollback). It is smallest at
K* = sqrt(2·C·M / T).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from axrl_spike_replay.errors import ConfigError

DEFAULT_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class IntervalOption:
    """Expected overhead of checkpointing every `interval_steps` steps."""

    interval_steps: int
    checkpoint_overhead: float  # fraction of time spent writing checkpoints
    expected_rework: float  # fraction of time spent redoing steps lost to rollbacks
    total_overhead: float


@dataclass(frozen=True)
class CheckpointIntervalAdvice:
    """The Young-Daly optimum and the overhead of intervals around it."""

    checkpoint_cost_s: float
    mtbf_steps: float
    step_time_s: float
    optimal_interval_steps: int
    optimal_interval_exact: float
    optimal_overhead: float
    options: list[IntervalOption] = field(default_factory=list)


def expected_overhead(interval_steps: float, checkpoint_cost_s: float, mtbf_steps: float, step_time_s: float) -> float:
    """Fraction of time lost at `interval_steps`: checkpoint writing plus expected rework."""
    return checkpoint_cost_s / (interval_steps * step_time_s) + interval_steps / (2.0 * mtbf_steps)


def _option(interval: int, cost: float, mtbf: float, step: float) -> IntervalOption:
    writing = cost / (interval * step)
    rework = interval / (2.0 * mtbf)
    return IntervalOption(interval, writing, rework, writing + rework)


def checkpoint_interval(
    checkpoint_cost_s: float,
    mtbf_steps: float,
    step_time_s: float,
    factors: tuple[float, ...] = DEFAULT_FACTORS,
) -> CheckpointIntervalAdvice:
    """K* = sqrt(2 · checkpoint_cost · mtbf_steps / step_time) steps, with the overhead at K*·factor."""
    for name, value in (
        ("checkpoint_cost_s", checkpoint_cost_s),
        ("mtbf_steps", mtbf_steps),
        ("step_time_s", step_time_s),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    try:
        exact = math.sqrt(2.0 * checkpoint_cost_s * mtbf_steps / step_time_s)
        optimal = max(1, round(exact))
        intervals = sorted({max(1, round(exact * f)) for f in factors} | {optimal})
        options = [_option(k, checkpoint_cost_s, mtbf_steps, step_time_s) for k in intervals]
        optimal_overhead = expected_overhead(optimal, checkpoint_cost_s, mtbf_steps, step_time_s)
    except (OverflowError, ZeroDivisionError):  # round(inf), int too large for a float, a product underflowing to 0
        raise _out_of_range(checkpoint_cost_s, mtbf_steps, step_time_s) from None
    figures = [exact, optimal_overhead, *(x for o in options for x in (o.checkpoint_overhead, o.expected_rework))]
    if not all(math.isfinite(x) for x in figures):
        raise _out_of_range(checkpoint_cost_s, mtbf_steps, step_time_s)
    return CheckpointIntervalAdvice(
        checkpoint_cost_s=float(checkpoint_cost_s),
        mtbf_steps=float(mtbf_steps),
        step_time_s=float(step_time_s),
        optimal_interval_steps=optimal,
        optimal_interval_exact=exact,
        optimal_overhead=optimal_overhead,
        options=options,
    )


def _out_of_range(cost: float, mtbf: float, step: float) -> ConfigError:
    return ConfigError(
        f"checkpoint_cost_s={cost:g}, mtbf_steps={mtbf:g}, step_time_s={step:g} are out of range: "
        "the interval K* = sqrt(2 * checkpoint_cost_s * mtbf_steps / step_time_s) or its overhead is not a finite "
        "number; use realistic seconds and steps"
    )
