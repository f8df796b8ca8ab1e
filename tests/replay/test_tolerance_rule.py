"""The baseline verdict's tolerance accounts for kernels that are not bit-deterministic and for the recorded
precision, and the result says which rule judged it."""

from __future__ import annotations

from axrl_spike_replay.experiment.verdict import CUDA_TOLERANCE, PRECISION_TOLERANCE, TOLERANCE, tolerance_rule
from axrl_spike_replay.vocabulary import Fidelity


def test_a_float32_cpu_replay_is_held_to_its_layout():
    value, rule = tolerance_rule(Fidelity.FULL, "cpu", "float32", [2.0, 2.0, 2.0])
    assert value == TOLERANCE[Fidelity.FULL] and "full fidelity layout" in rule


def test_gpu_kernels_and_a_16_bit_recording_loosen_it_and_say_so():
    value, rule = tolerance_rule(Fidelity.FULL, "cuda:0", "float32")
    assert value == CUDA_TOLERANCE and "GPU kernels" in rule
    value, rule = tolerance_rule(Fidelity.FULL, "cuda:0", "bfloat16")
    assert value == PRECISION_TOLERANCE["bfloat16"] and "recorded precision's (bfloat16)" in rule


def test_repeats_that_differ_are_judged_by_their_own_spread():
    # a non-deterministic kernel: three repeats 3 % apart
    value, rule = tolerance_rule(Fidelity.FULL, "cuda", "bfloat16", [10.0, 10.3, 10.1])
    assert value > PRECISION_TOLERANCE["bfloat16"] and "own spread over 3 repeats" in rule
    assert abs(value - 3 * 0.3 / (30.4 / 3)) < 1e-12
    # repeats that agree leave the other rules in charge
    assert tolerance_rule(Fidelity.FULL, "cuda", "bfloat16", [10.0, 10.0])[1].startswith("the recorded precision")
