"""The per-rank reading of a signal check on its own: which stored signal is the odd one out, from figures as the
replay reports them (no model needed to state the comparison)."""

from __future__ import annotations

from axrl_spike_replay.diagnosis.evidence.signal_reading import read_signals
from axrl_spike_replay.experiment.step_evidence import PairFigures, RankSignals, SignalCheck


def _pair(name: str, mean_abs: float, outside: float) -> PairFigures:
    return PairFigures(pair=name, tokens=64, mean_abs=mean_abs, max_abs=4 * mean_abs, outside=outside, mean=-mean_abs)


def _rank(rank: int, ref_mean_abs: float, ref_outside: float, typical: float) -> RankSignals:
    pairs = {
        "current_vs_old": _pair("current_vs_old", 0.0, 0.0),
        "current_vs_rollout": _pair("current_vs_rollout", 0.01, 0.0),
        "current_vs_ref": _pair("current_vs_ref", ref_mean_abs, ref_outside),
    }
    return RankSignals(rank=rank, pairs=pairs, samples=8, samples_mean_logprob=[typical] * 8)


def test_a_reference_furthest_off_on_the_rank_whose_data_the_policy_finds_unlikely_is_that_datas_drift() -> None:
    """Rank 1 was fed data the policy finds 9 nats per token less likely (a foreign shard): the policy has moved
    furthest from its reference exactly there, so a reference 3.4x further off on that rank singles nothing out."""
    check = SignalCheck(ranks=[_rank(0, 1.0, 0.28, -0.03), _rank(1, 3.3, 0.95, -9.5)])
    reading = read_signals(check)
    ref = reading.odd_signal("ref")
    assert ref is not None and not ref.separated and ref.spread


def test_the_same_reference_gap_on_a_rank_fed_alike_data_singles_its_reference_out() -> None:
    check = SignalCheck(ranks=[_rank(0, 1.0, 0.28, -0.03), _rank(1, 3.3, 0.95, -0.05)])
    reading = read_signals(check)
    ref = reading.odd_signal("ref")
    assert ref is not None and ref.separated and ref.ranks == [1]


def test_a_ranks_surprise_is_how_far_its_tokens_are_past_the_policys_own_entropy() -> None:
    on_policy = _rank(0, 1.0, 0.28, -0.4)
    on_policy.samples_mean_entropy = [0.5] * 8
    foreign = _rank(1, 1.0, 0.28, -9.5)
    foreign.samples_mean_entropy = [0.5] * 8
    reading = read_signals(SignalCheck(ranks=[on_policy, foreign]))
    assert abs(reading.surprise[0] - (-0.1)) < 1e-9 and abs(reading.surprise[1] - 9.0) < 1e-9


def _filled(rank: int, old_zeros: int, ref_zeros: int) -> RankSignals:
    """A rank whose stored old and reference log-probs hold `old_zeros` / `ref_zeros` 0 fills on its 64 loss tokens
    (6 nats off there), the engine's rollout log-probs (stored over the whole sequence) agreeing."""

    def off(name: str, zeros: int) -> PairFigures:
        pair = _pair(name, 6.0 * zeros / 64, zeros / 64)
        pair.zeros = zeros
        return pair

    pairs = {
        "current_vs_old": off("current_vs_old", old_zeros),
        "current_vs_rollout": _pair("current_vs_rollout", 0.01, 0.0),
        "current_vs_ref": off("current_vs_ref", ref_zeros),
    }
    return RankSignals(rank=rank, pairs=pairs, samples=8, samples_mean_logprob=[-0.1] * 8)


def test_two_stored_signals_zero_filled_on_the_same_loss_tokens_are_the_mask_not_two_broken_signals() -> None:
    """Rank 1's loss covers 48 tokens its trainer stored no old and no reference log-prob for (an inverted mask);
    its engine scored the whole sequence, so the rollout log-probs hold values there: the mask is the odd input."""
    reading = read_signals(SignalCheck(ranks=[_filled(0, 0, 0), _filled(1, 48, 48)]))
    assert reading.mask_ranks == {1: 0.75} and reading.mask_signals == {1: ["old", "ref"]}
    assert reading.odd_signal("old") is None  # the mask explains rank 1's old log-probs


def test_one_stored_signal_zero_filled_alone_is_that_signal() -> None:
    reading = read_signals(SignalCheck(ranks=[_filled(0, 0, 0), _filled(1, 48, 0)]))
    assert reading.mask_ranks == {}
    old = reading.odd_signal("old")
    assert old is not None and old.ranks == [1] and old.zero_filled
