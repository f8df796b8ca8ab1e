"""Every experiment `diagnose` suggests is a ready `--mitigation` item: `replay --mitigation ITEM` takes it
verbatim, and a `drop_samples` value names exactly the samples the evidence names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from snapshot_edits import diagnosed

from axrl_spike_replay.diagnosis.diagnose import Diagnosis, diagnose_snapshot
from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
from axrl_spike_replay.training.sample_masks import pairs_of, parse_pairs

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"


def _copy(tmp_path: Path) -> Path:
    out = tmp_path / FIXTURE.name
    shutil.copytree(FIXTURE, out)
    return out / "checkpoints" / "spike_snapshots" / "iter_0000021"


def _scaled_advantage(snapshot: Path, rank: int, sample: int, factor: float) -> None:
    """No log-prob mismatch left (rollout = old); one sample's advantage scaled by `factor`."""
    for path in snapshot.glob("batch_rank*.pt"):
        batch = torch.load(path, weights_only=True)
        batch["rollout_logprobs"] = batch["old_logprobs"].clone()
        if path.name == f"batch_rank{rank}.pt":
            batch["advantages"][sample] *= factor
        torch.save(batch, path)


def assert_ready_items(d: Diagnosis) -> None:
    """What the CLI does with `--mitigation ITEM`, for every suggestion; drop_samples pairs kept as written."""
    assert d.mitigation_items(), "a likely cause comes with experiments"
    for item in d.mitigation_items():
        config = parse_mitigation_args([item])
        name, _, value = item.partition("=")
        if name == "drop_samples":
            assert config["drop_samples"] == parse_pairs(name, value) == sorted(value.split(","))
            assert pairs_of(config["drop_samples"])


def test_the_log_prob_mismatch_suggestions_parse_verbatim(tmp_path: Path) -> None:
    d = diagnose_snapshot(_copy(tmp_path), model="never")
    assert d.causes[0].family == "engine_mismatch" and d.mitigation_items()[0] == "mismatch_token_clip_max=2"
    assert_ready_items(d)


def test_an_outlier_advantage_suggests_its_mask_then_dropping_exactly_that_sample(tmp_path: Path) -> None:
    snapshot = _copy(tmp_path)
    _scaled_advantage(snapshot, rank=1, sample=3, factor=200.0)
    d = diagnose_snapshot(snapshot, model="never")
    assert d.causes[0].family == "outlier_advantage"
    items = d.mitigation_items()
    assert items[0].startswith("advantage_outlier_mask=") and items[1] == "drop_samples=1:3"
    assert_ready_items(d)
    assert parse_mitigation_args([items[1]])["drop_samples"] == ["1:3"]


def test_two_pairs_read_as_diagnose_writes_them() -> None:
    assert parse_mitigation_args(["drop_samples=0:3,1:2"])["drop_samples"] == ["0:3", "1:2"]
    assert parse_pairs("drop_samples", "1:2,0:3") == ["0:3", "1:2"]


@pytest.mark.slow
def test_a_stale_route_table_in_one_layer_is_diagnosed_as_a_routing_payload_fault(tmp_path: Path) -> None:
    """The reference engine's `stale_route_layer` fault, applied to a captured snapshot: layer 1's recorded
    routes come from a stale expert table (every expert id shifted by one), so they disagree with the trainer's
    router on nearly every token while layer 0 agrees."""
    snapshot = _copy(tmp_path)
    for path in snapshot.glob("routing_payload_rank*.pt"):
        payload = torch.load(path, weights_only=True)
        routes = payload["routed_experts"]
        layer = routes[:, :, 1, :]
        routes[:, :, 1, :] = torch.where(layer >= 0, (layer + 1) % 4, layer)
        torch.save(payload, path)
    d = diagnosed(snapshot, model="always")  # recorded as trained on the stale table
    routing = next(c for c in d.causes if c.family == "routing_payload")
    assert routing.strength >= 0.3 and routing in d.causes[:2]
    assert routing.ranks == []  # every rank: the table, not one rank's payload
    # the witness: the stored old log-probs agree with the model's own routing, not with the recorded routes
    assert any("agree with the model's own routing" in line for line in routing.evidence)
    assert d.routes is not None
    by_layer = {x.layer: x for x in d.routes.layers}
    assert by_layer[1].loss_disagreement is not None and by_layer[1].loss_disagreement > 0.9
    assert by_layer[1].other_disagreement is not None and by_layer[1].other_disagreement > 0.9
    assert (by_layer[0].loss_disagreement or 0.0) < 0.2
    assert routing.figures["layers"] == [1]
    assert "layer 0: 0.0 % of loss tokens" in routing.evidence[0] and "layer 1: 100.0 % of loss" in routing.evidence[0]
    assert "current_routing_layers=1" in d.mitigation_items()
    assert_ready_items(d)
