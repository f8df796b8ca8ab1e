"""The diagnosis suggests the newer objectives where the stored log-probs point to them, on copies of the captured
golden snapshot whose rollout log-probs are edited into each shape: GSPO's sequence-level ratio where token ratios
are extreme but every sequence holding one agrees as a whole, CISPO where a few tokens carry the ratios' excess,
neither where the mismatch is broad (the golden capture as recorded) or absent. The suggestion names its evidence
and runs on the snapshot's config, under every convention it has a meaning in."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from snapshot_edits import copy_fixture, edit_batch

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.diagnosis.evidence.ratio_shape import read_ratio_shape
from axrl_spike_replay.diagnosis.rules.causes import Experiment
from axrl_spike_replay.diagnosis.suggestions.convention_experiments import in_convention
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_mitigation_args
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.training.trl_settings import TrlSettings

GSPO, CISPO = "importance_sampling_level=sequence", "trl_loss_type=cispo"


def _rollout(snapshot: Path, offsets: dict[int, list[tuple[int, int, float]]]) -> None:
    """Every rank's rollout log-probs made the trainer's, then log(old / rollout) = NATS at (sample, k-th loss token)
    for each (sample, k, nats) of the rank in `offsets`."""
    for rank in (0, 1):

        def edit(b: dict[str, Any], rank: int = rank) -> None:
            rollout = b["old_logprobs"].clone()
            for sample, k, nats in offsets.get(rank, []):
                column = int(b["loss_mask"][sample].nonzero()[k])
                rollout[sample, column] -= nats
            b["rollout_logprobs"] = rollout

        edit_batch(snapshot, rank, edit)


def _pairs() -> dict[int, list[tuple[int, int, float]]]:
    """Each sequence: one token at ratio e^1.5, one at e^-1.5 (both outside [0.5, 2]), the sequence's mean 0."""
    return {rank: [(s, k, n) for s in range(8) for k, n in ((1, 1.5), (5, -1.5))] for rank in (0, 1)}


def _few() -> dict[int, list[tuple[int, int, float]]]:
    """One token per rank at ratio e^5, the rest 1: its sequence's mean log-ratio 5/8 is outside [0.8, 1.2]."""
    return {0: [(2, 3, 5.0)], 1: [(6, 0, 5.0)]}


def _items(snapshot: Path) -> list[str]:
    return diagnose_snapshot(snapshot, model="never").mitigation_items()


def test_token_ratios_extreme_where_sequences_agree_suggest_gspo_not_cispo(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    _rollout(snapshot, _pairs())
    shape = read_ratio_shape(snapshot, 0.8, 1.2)
    assert shape is not None and (shape.extreme_tokens, shape.extreme_sequences, shape.agreeing_sequences) == (
        32,
        16,
        16,
    )
    excess = math.exp(1.5) - 1 + 1 - math.exp(-1.5)
    assert shape.top_share == pytest.approx(2 * (math.exp(1.5) - 1) / (16 * excess))
    d = diagnose_snapshot(snapshot, model="never")
    items = d.mitigation_items()
    assert items[0] == "mismatch_token_clip_max=2" and items[1] == GSPO and CISPO not in items
    why = next(e.why for c in d.causes for e in c.experiments if e.mitigation == GSPO)
    assert "32 of 128 loss tokens" in why and "16 of which agree as wholes" in why


def test_a_few_dominant_token_ratios_suggest_cispo_not_gspo(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    _rollout(snapshot, _few())
    shape = read_ratio_shape(snapshot, 0.8, 1.2)
    assert shape is not None and (shape.extreme_tokens, shape.agreeing_sequences, shape.top_tokens) == (2, 0, 2)
    assert shape.top_share == pytest.approx(1.0)
    items = _items(snapshot)
    assert items[0] == "mismatch_token_clip_max=2" and CISPO in items and GSPO not in items


def test_a_broad_mismatch_suggests_neither(tmp_path: Path) -> None:
    """The golden capture as recorded: most tokens' ratios are off, in every sequence, and no few carry them."""
    snapshot = copy_fixture(tmp_path)
    shape = read_ratio_shape(snapshot, 0.8, 1.2)
    assert shape is not None and shape.extreme_tokens > shape.loss_tokens / 2 and shape.agreeing_sequences == 0
    assert shape.top_share < 0.5
    items = _items(snapshot)
    assert items[0] == "mismatch_token_clip_max=2" and GSPO not in items and CISPO not in items


def test_without_a_mismatch_there_is_no_shape_to_point_anywhere(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    _rollout(snapshot, {})
    shape = read_ratio_shape(snapshot, 0.8, 1.2)
    assert shape is not None and shape.extreme_tokens == 0 and shape.top_share == 0.0
    edit_batch(snapshot, 1, lambda b: b.pop("rollout_logprobs"))
    assert read_ratio_shape(snapshot, 0.8, 1.2) is None  # a rank without rollout log-probs: no shape, no suggestion


@pytest.mark.parametrize("convention", ["axrl", "verl", "trl"])
def test_the_objectives_are_suggested_under_each_convention_and_run_there(convention: str, tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    _rollout(snapshot, _pairs())
    gspo_shape = read_ratio_shape(snapshot, 0.8, 1.2)
    _rollout(snapshot, _few())
    cispo_shape = read_ratio_shape(snapshot, 0.8, 1.2)
    loss = LossConfig(convention=convention, trl=TrlSettings() if convention == "trl" else None)
    suggested = [Experiment("mismatch_token_clip_max=2", "truncated IS"), Experiment("advantage_clip=1", "clip")]
    for shape, expected in ((gspo_shape, GSPO), (cispo_shape, CISPO)):
        items = [e.mitigation for e in in_convention(suggested, loss, RoutingConfig(), shape)]
        assert items == ["mismatch_token_clip_max=2", expected, "advantage_clip=1"]
        apply_config(parse_mitigation_args([expected]), loss, RoutingConfig())  # runs on the snapshot's config
    assert [e.mitigation for e in in_convention(suggested, loss, RoutingConfig(), None)] == [
        "mismatch_token_clip_max=2",
        "advantage_clip=1",
    ]
