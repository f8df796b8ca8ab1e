"""A step that does not reproduce is explained from each rank's record against the replay: which ranks differ, by
one factor, a factor per layer or per parameter family, or by no pattern at all; and the recorded global norm is
predicted from the replay's own per-rank gradients scaled as found. A captured run whose rank 1 accumulates its
gradients 16-fold without dividing (the reference trainer's `grad_scale` fault) is diagnosed as exactly that."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from axrl_spike_replay.capture.fault_injection.faults import make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot, render_diagnosis
from axrl_spike_replay.diagnosis.rules.reproduction import Prediction, predict, read_rank, reproduction_cause
from axrl_spike_replay.experiment.step_evidence import LossChannel

REPLAYED = {"blocks.0.qkv.weight": 1.0, "blocks.0.ffn.w_in": 2.0, "blocks.1.qkv.weight": 0.5, "head.weight": 3.0}


def scaled(by: dict[str, float]) -> dict[str, float]:
    return {name: norm * by.get(name, 1.0) for name, norm in REPLAYED.items()}


def test_a_rank_s_record_reads_as_one_factor_a_factor_per_layer_or_family_or_no_pattern() -> None:
    same = read_rank(0, dict(REPLAYED), dict(REPLAYED), (1.0, 1.0))
    assert same.matches and same.pattern == "match"
    whole = read_rank(1, scaled(dict.fromkeys(REPLAYED, 16.0)), dict(REPLAYED), (1.0, 1.0))
    assert whole.pattern == "one_factor" and whole.factor == pytest.approx(16.0) and not whole.loss_scaled
    loss = read_rank(1, scaled(dict.fromkeys(REPLAYED, 4.0)), dict(REPLAYED), (4.0, 1.0))
    assert loss.pattern == "one_factor" and loss.loss_scaled
    layer = read_rank(2, scaled({"blocks.1.qkv.weight": 64.0}), dict(REPLAYED), (1.0, 1.0))
    assert layer.pattern == "by_layer" and layer.groups["layer 1"] == pytest.approx(64.0)
    assert layer.groups["layer 0"] == pytest.approx(1.0)
    family = read_rank(0, scaled({"blocks.0.ffn.w_in": 8.0}), dict(REPLAYED), (1.0, 1.0))
    assert family.pattern == "by_family" and family.groups["experts"] == pytest.approx(8.0)
    other = read_rank(3, scaled({"blocks.0.qkv.weight": 3.0, "blocks.0.ffn.w_in": 0.2, "head.weight": 7.0}),
                      dict(REPLAYED), (2.0, 1.0))  # fmt: skip
    assert other.pattern == "none" and not other.scale


def test_the_recorded_norm_is_predicted_from_the_ranks_gradients_scaled_as_found() -> None:
    # two ranks, one parameter: g0 = (1, 0), g1 = (1, 1); rank 1 scaled by 3 -> reduced (1 + 3, 3) / 2
    gram = {"ranks": [0, 1], "params": {"head.weight": [[1.0, 1.0], [1.0, 2.0]]}}
    channel = LossChannel(grad_norm=math.hypot(2, 1) / 2, param_gram=gram)
    ok = read_rank(0, {"head.weight": 1.0}, {"head.weight": 1.0}, (None, None))
    hit = read_rank(1, {"head.weight": 3 * math.sqrt(2)}, {"head.weight": math.sqrt(2)}, (None, None))
    found = predict([ok, hit], channel, recorded=2.5, world=2)
    assert found is not None and found.predicted == pytest.approx(2.5) and found.holds
    cause = reproduction_cause([ok, hit], 2.5, channel.grad_norm, found)
    assert cause is not None and cause.family == "step_not_reproduced" and cause.ranks == [1]
    assert cause.strength == 1.0 and "x3" in cause.title
    # a rank with no pattern has no scale: its recorded local norm only bounds its part
    odd = read_rank(1, {"blocks.0.qkv.weight": 1.0, "blocks.1.qkv.weight": 3.0, "blocks.0.ffn.w_in": 3.0},
                    dict.fromkeys(("blocks.0.qkv.weight", "blocks.1.qkv.weight", "blocks.0.ffn.w_in"), 1.0),
                    (None, None))  # fmt: skip
    assert odd.pattern == "none"
    bounds = predict([ok, odd], channel, recorded=2.5, world=2)
    assert bounds is not None and bounds.predicted is None and bounds.low <= 2.5 <= bounds.high
    assert not Prediction(2.0, 2.0, 2.0, 2.5).holds


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The spike snapshot of a run whose rank 1 accumulates 16 micro-batches' gradients without dividing."""
    logging.getLogger("axrl_spike_replay.guard").setLevel(logging.ERROR)
    out = tmp_path_factory.mktemp("accumulated")
    fault = make_fault(FaultSpec("grad_scale", ranks=(1,), params={"factor": 16.0}))
    run = capture_reference_run(
        out, job="accumulated", world_size=2, steps=3, preset="peaked", faults=[fault],
        overrides={"train": {"burst": [3]}},
    )  # fmt: skip
    assert 3 in run.spike_iterations, run.grad_norms
    return run.snapshot_dirs[run.spike_iterations.index(3)]


@pytest.mark.slow
def test_a_step_scaled_on_one_rank_is_explained_first_with_its_factor_and_prediction(accumulated: Path) -> None:
    diagnosis = diagnose_snapshot(accumulated, model="always")
    top = diagnosis.causes[0]
    assert top.family == "step_not_reproduced" and top.ranks == [1] and top.strength == 1.0
    rank = top.figures["ranks"]["1"]
    assert rank["pattern"] == "one_factor" and abs(rank["factor"] / 16.0 - 1) <= 0.01
    assert top.figures["matching_ranks"] == [0] and top.figures["prediction_holds"]
    assert abs(top.figures["predicted_grad_norm"] / diagnosis.grad_norm - 1) <= 1e-4
    assert all(c.family != "natural_spike" for c in diagnosis.causes)
    text = render_diagnosis(diagnosis)
    assert "a replay cannot undo a trainer-side scale" in text and "param_grad_norms_vs_replay" not in "".join(
        diagnosis.not_checked
    )


def test_a_rank_whose_recorded_norms_are_not_finite_where_the_replays_are_differs_with_no_factor() -> None:
    """A gradient past the float range on one rank records inf per-parameter norms (the rank's loss as replayed):
    nothing is left to compare, and that is no match."""
    overflowed = read_rank(0, dict.fromkeys(REPLAYED, math.inf), dict(REPLAYED), (1.0, 1.0))
    assert not overflowed.matches and overflowed.pattern == "none" and overflowed.non_finite == len(REPLAYED)
    partly = read_rank(0, {**REPLAYED, "blocks.1.qkv.weight": math.nan}, dict(REPLAYED), (1.0, 1.0))
    assert not partly.matches and partly.non_finite == 1
    assert read_rank(0, dict(REPLAYED), dict(REPLAYED), (1.0, 1.0)).matches


def test_a_rank_whose_recorded_norms_overflowed_bounds_the_recorded_norm_from_below_only() -> None:
    """Rank 1's trainer computed a gradient past float32's range (its recorded per-parameter norms are inf) while its
    recorded loss is the replay's, and the global norm it recorded (in float64) is finite and huge: its part is
    unbounded, so the prediction is a lower bound the record lies above, not a bound it breaks; and the finding says
    the forward reproduces, so what differs comes after the loss."""
    gram = {"ranks": [0, 1], "params": {"head.weight": [[1.0, 1.0], [1.0, 2.0]]}}
    channel = LossChannel(grad_norm=math.hypot(2, 1) / 2, param_gram=gram)
    ok = read_rank(0, {"head.weight": 1.0}, {"head.weight": 1.0}, (0.3, 0.3))
    overflowed = read_rank(1, {"head.weight": math.inf}, {"head.weight": math.sqrt(2)}, (0.3, 0.3))
    found = predict([ok, overflowed], channel, recorded=6.6e29, world=2)
    assert found is not None and found.predicted is None and math.isinf(found.high) and found.holds
    cause = reproduction_cause([ok, overflowed], 6.6e29, channel.grad_norm, found)
    assert cause is not None and cause.ranks == [1]
    text = " ".join(cause.evidence)
    assert "bound the recorded grad norm from below only" in text and "lies above it" in text
    assert "lies outside" not in text
    assert "the rank's forward reproduces (its recorded loss is the replay's) while its gradient does not" in text
    assert "the trainer computed that rank's step differently from the model" in text
