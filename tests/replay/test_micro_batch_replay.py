"""A rank's step replayed micro-batch by micro-batch, as a trainer that accumulates micro-batches computed it.

The trainer here is the trainer's own step functions run the way Megatron-core's schedule runs them: each
micro-batch forwarded and its loss (normalised by its own tokens: `token-mean`, `normalization: per_rank`) divided
by the number of micro-batches, the gradients accumulated, then the DP mean. The ranks' responses differ in length
(tiny_snapshot's `rank_lengths`), so the micro-batches hold different token counts and the mean of their token
means is not the token mean of the rank: the flattened replay (`micro_batches: {split: whole}`) computes another
gradient, and the replay of the recorded split reproduces the trainer's, whole or sharded over two processes,
whatever each rank's number of micro-batches.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from tiny_snapshot import LOSS, MODEL, record_tiny_snapshot, split_into_micro_batches

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.models.tiny_moe import TinyMoEPolicy
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.micro_batches import MicroBatch, take, take_routing
from axrl_spike_replay.training.rank_step import global_grad_norm, rank_forward_backward
from axrl_spike_replay.training.routing_replay import RoutingConfig, routing_control
from axrl_spike_replay.vocabulary import Shard, Verb

PROMPT = 4
RANK_LENGTHS = (  # (prompt, response) tokens per sample, per rank: responses of 0 to 8 tokens
    ((4, 2, 3, 1, 4, 3), (8, 5, 7, 0, 3, 8)),
    ((2, 4, 1, 3, 2, 4), (2, 0, 6, 1, 8, 3)),
)
SPLITS = {0: (4, 2), 1: (1, 2, 3)}  # each rank's micro-batches (sequences), as the trainer split them
SAME = 1e-6


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny snapshot whose batch files hold the trainer's micro-batches (`{"micro_batches": [...]}`)."""
    loss = {**LOSS, "loss_agg_mode": "token-mean", "normalization": "per_rank"}
    snap = record_tiny_snapshot(tmp_path_factory.mktemp("micro"), rank_lengths=RANK_LENGTHS, prompt=PROMPT, loss=loss)
    split_into_micro_batches(snap, SPLITS)
    return snap


def trainer_grad_norm(snap: Path, sizes: dict[int, tuple[int, ...]], weights: dict[int, float] | None = None) -> float:
    """The global grad norm of the trainer that ran each rank in `sizes`' micro-batches (Megatron-core's schedule:
    each micro-batch's loss over the micro-batch count, accumulated; then the DP mean); `weights` multiply a rank's
    whole loss (a hypothesis' `loss_scale`; 0: the rank left out)."""
    torch.manual_seed(0)  # the policy record_tiny_snapshot builds, with the weights it saved
    model = TinyMoEPolicy(MODEL)
    doc = yaml.safe_load((snap / "run_config.yaml").read_text())
    loss, routing = LossConfig.from_dict(doc["loss"]), RoutingConfig.from_dict(doc["routing"])
    total = [torch.zeros_like(p) for p in model.parameters()]
    for rank, split in sizes.items():
        batch = load_rank_batch(snap, rank)
        payload = load_rank_routes(snap, rank, batch=batch)
        assert payload is not None
        control = routing_control(routing, batch, payload.routed_experts)
        start = 0
        for size in split:
            mb = MicroBatch(tuple(range(start, start + size)), int(batch["tokens"].shape[1]), 1.0 / len(split))
            start += size
            model.zero_grad(set_to_none=True)
            rank_forward_backward(model, take(batch, mb), loss, take_routing(control, mb, len(batch["tokens"])))
            for t, p in zip(total, model.parameters(), strict=True):
                if p.grad is not None:
                    t.add_(p.grad, alpha=mb.scale * (weights or {}).get(rank, 1.0))
    for p, t in zip(model.parameters(), total, strict=True):
        p.grad = t / len(sizes)
    return global_grad_norm(model)


def with_section(snap: Path, tmp: Path, section: dict[str, Any] | None) -> Path:
    """A copy of `snap` whose run config has `section` as its `micro_batches:` (None: none)."""
    copy = tmp / "copy" / snap.name
    shutil.copytree(snap, copy)
    doc = yaml.safe_load((copy / "run_config.yaml").read_text())
    doc.pop("micro_batches", None)
    if section is not None:
        doc["micro_batches"] = section
    (copy / "run_config.yaml").write_text(yaml.safe_dump(doc))
    return copy


def _rel(a: float | None, b: float) -> float:
    assert a is not None, "the replay gave no grad norm"
    return abs(a - b) / abs(b)


def test_the_recorded_micro_batches_replay_as_the_trainer_ran_them(snapshot: Path) -> None:
    expected = trainer_grad_norm(snapshot, SPLITS)
    result = run_replay(replay_request(What(snapshot)))
    assert _rel(result.grad_norm, expected) <= SAME, (result.grad_norm, expected)
    losses = {m["rank"]: m["loss"] for m in result.rank_metrics}
    assert set(losses) == {0, 1}, "one row per rank, its loss the micro-batches' scaled sum"


def test_the_flattened_replay_is_not_the_trainers_step(snapshot: Path, tmp_path: Path) -> None:
    flat = with_section(snapshot, tmp_path, {"split": "whole"})
    expected = trainer_grad_norm(snapshot, SPLITS)
    whole = run_replay(replay_request(What(flat)))
    assert _rel(whole.grad_norm, expected) > 0.01, "flattened: the token mean over the rank, not the trainer's"
    assert _rel(whole.grad_norm, trainer_grad_norm(snapshot, {0: (6,), 1: (6,)})) <= SAME


def test_sharded_replay_with_uneven_micro_batch_counts_is_the_same(snapshot: Path) -> None:
    """Two FSDP2 processes, one rank each, with 2 and 3 micro-batches: the one with fewer makes a padding pass so
    the collectives stay in step, and the gradient is the trainer's."""
    expected = trainer_grad_norm(snapshot, SPLITS)
    result = run_replay(replay_request(What(snapshot), how=How(nproc=2, shard=Shard.ON)))
    assert _rel(result.grad_norm, expected) <= SAME, (result.grad_norm, expected)


def test_a_size_from_the_run_config_splits_each_rank(snapshot: Path, tmp_path: Path) -> None:
    sized = with_section(snapshot, tmp_path, {"split": "size", "size": 3})
    result = run_replay(replay_request(What(sized)))
    assert _rel(result.grad_norm, trainer_grad_norm(snapshot, {0: (3, 3), 1: (3, 3)})) <= SAME


def test_a_reduced_replay_keeps_each_ranks_micro_batches(snapshot: Path) -> None:
    result = run_replay(replay_request(What(snapshot), how=How(nproc=1)))
    assert _rel(result.grad_norm, trainer_grad_norm(snapshot, SPLITS)) <= SAME


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"split": "size", "size": 4}, ["batch_rank0.pt", "micro_batches.size 4", "does not tile", "6 sequences"]),
        ({"split": "token_budget", "max_token_len": 9}, ["batch_rank", "micro_batches.max_token_len 9", "breaks"]),
    ],
)
def test_a_split_the_batch_breaks_is_refused_naming_the_file_and_field(
    snapshot: Path, tmp_path: Path, section: dict[str, Any], words: list[str]
) -> None:
    bad = with_section(snapshot, tmp_path, section)
    before = sorted(p.name for p in bad.rglob("*"))
    workspace = tmp_path / "ws"
    with pytest.raises(SnapshotError) as info:
        run_replay(replay_request(What(bad)))
    for word in words:
        assert word in str(info.value), str(info.value)
    assert sorted(p.name for p in bad.rglob("*")) == before and not workspace.exists(), "nothing written"


def test_a_recorded_split_that_does_not_tile_the_batch_is_refused(snapshot: Path, tmp_path: Path) -> None:
    bad = with_section(snapshot, tmp_path, None)
    path = bad / "batch_rank1.pt"
    raw = torch.load(path, weights_only=True)
    flat = {k: torch.cat([p[k] for p in raw["micro_batches"]]) for k in raw["micro_batches"][0]}
    torch.save({**flat, "micro_batch_rows": torch.tensor([2, 2])}, path)  # 4 of its 6 sequences
    with pytest.raises(SnapshotError, match=r"batch_rank1\.pt: micro_batch_rows \[2, 2\] does not tile"):
        run_replay(replay_request(What(bad)))


def test_an_unknown_micro_batch_setting_is_refused_naming_the_run_config(snapshot: Path, tmp_path: Path) -> None:
    from axrl_spike_replay.errors import ConfigError

    bad = with_section(snapshot, tmp_path, {"split": "size"})
    with pytest.raises(ConfigError, match=r"run_config\.yaml: micro_batches\.split size needs micro_batches\.size"):
        run_replay(replay_request(What(bad)))


def test_attribution_ranks_samples_across_the_micro_batches_of_the_trainers_step(snapshot: Path) -> None:
    """Attribution computes each rank's loss micro-batch by micro-batch: its gradient is the trainer's, and the
    samples' contributions, each from its own micro-batch, add up to it."""
    from axrl_spike_replay.investigation.request import What, replay_request
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike

    expected = trainer_grad_norm(snapshot, SPLITS)
    attribution = attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=3)))
    assert _rel(attribution.grad_norm, expected) <= SAME
    assert attribution.sum_rel_error <= 1e-5
    per_sample = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=3, method="per_sample_backward"))
    )
    assert [(s.rank, s.sample) for s in per_sample.samples] == [(s.rank, s.sample) for s in attribution.samples]


def test_sharded_attribution_refuses_ranks_of_different_micro_batch_counts(snapshot: Path) -> None:
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike

    with pytest.raises(AxrlError, match="same number of micro-batches"):
        attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=3), how=How(shard="on", nproc=2)))


def test_the_step_evidence_reads_the_trainers_rank_losses(snapshot: Path) -> None:
    """The diagnosis' loss channel splits the micro-batched loss: each rank's loss is the replay's."""
    from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence

    replay = run_replay(replay_request(What(snapshot)))
    evidence = step_evidence(snapshot, shard="off")
    replayed = {m["rank"]: m["loss"] for m in replay.rank_metrics}
    assert evidence.channel is not None
    for row in evidence.channel.rank_losses:
        assert abs(row["loss"] - replayed[row["rank"]]) <= 1e-6 * abs(replayed[row["rank"]])


@pytest.mark.parametrize(
    ("mitigations", "weights"),
    [({"loss_scale": "2.5@1"}, {1: 2.5}), ({"drop_ranks": "1"}, {1: 0.0})],
)
def test_per_rank_hypotheses_and_left_out_ranks_go_through_the_same_micro_batches(
    snapshot: Path, mitigations: dict[str, str], weights: dict[int, float]
) -> None:
    """A hypothesis scaling one rank's loss, and a rank left out, on the micro-batched step: each micro-batch of
    that rank scaled (or left out) as a whole rank's loss would be."""
    result = run_replay(replay_request(What(snapshot, mitigations=mitigations), how=How(nproc=1)))
    assert _rel(result.grad_norm, trainer_grad_norm(snapshot, SPLITS, weights)) <= SAME


def test_the_plan_counts_one_micro_batchs_activations(snapshot: Path, tmp_path: Path) -> None:
    """The plan holds a process to one micro-batch's activations (the largest: 4 of rank 0's 6 sequences), and
    says so; flattened, it counts the whole rank's."""
    from axrl_spike_replay.replay.plans.replay_plan import plan_replay

    micro = plan_replay(snapshot, nproc=1, capacity=None, shard="off")
    whole = plan_replay(with_section(snapshot, tmp_path, {"split": "whole"}), nproc=1, capacity=None, shard="off")
    assert micro.chosen is not None and whole.chosen is not None
    assert micro.tokens_per_rank == whole.tokens_per_rank == 6 * 12
    assert micro.chosen.memory.activations < whole.chosen.memory.activations
    assert any("one micro-batch of 4 x 12 tokens" in note for note in micro.notes), micro.notes
    assert not any("micro-batch" in note for note in whole.notes)
