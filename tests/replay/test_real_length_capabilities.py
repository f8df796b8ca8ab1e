"""Attribution, diagnose's loss channel and the replay at real length: micro-batch by micro-batch (one micro-batch's
graph at a time), the head in chunks, the decoder layers checkpointed where the plan or the request says, against
the whole-graph path (`rank_micro_batches.rank_forward` / `rank_loss_of`: every micro-batch of a rank on one graph,
the way these analyses took a rank before) on the same tiny snapshot, float32, within 1e-6.

The snapshot: tiny_moe, saved world size 2, each rank's batch split by the trainer into uneven micro-batches (4 + 2
and 1 + 2 + 3 sequences of different response lengths), token-mean per micro-batch, KL, entropy and router terms.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_snapshot import LOSS, record_tiny_snapshot, split_into_micro_batches

from axrl_spike_replay.experiment.mitigation.mitigations import apply_config
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.models.policy import routing_shape
from axrl_spike_replay.replay.analyses.attribution import _gradient_pass, attribute_spike
from axrl_spike_replay.replay.analyses.rank_micro_batches import rank_forward, rank_loss_of
from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence
from axrl_spike_replay.replay.compute.model_build import Placement, build_model
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, config_loss, step_counts
from axrl_spike_replay.replay.engine import replay_dir_for, run_replay
from axrl_spike_replay.replay.plans.replay_plan import Capacity, plan_replay
from axrl_spike_replay.replay.reading.inputs import load_inputs
from axrl_spike_replay.vocabulary import Shard, Verb

SAME = 1e-6
PROMPT = 4
RANK_LENGTHS = (
    ((4, 2, 3, 1, 4, 3), (8, 5, 7, 0, 3, 8)),
    ((2, 4, 1, 3, 2, 4), (2, 0, 6, 1, 8, 3)),
)
SPLITS = {0: (4, 2), 1: (1, 2, 3)}


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny snapshot whose batch files hold the trainer's uneven micro-batches."""
    loss = {**LOSS, "entropy_coef": 0.01, "loss_agg_mode": "token-mean", "normalization": "per_rank"}
    snap = record_tiny_snapshot(tmp_path_factory.mktemp("real"), rank_lengths=RANK_LENGTHS, prompt=PROMPT, loss=loss)
    split_into_micro_batches(snap, SPLITS)
    return snap


def _rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _whole_graph(snap: Path, checkpoint: bool) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """The whole-graph path: per rank, every micro-batch on one graph, the rank's loss backpropagated at once;
    (dLoss/dlogprobs per rank, the summed gradient)."""
    with replay_dir_for(snap) as (replay_dir, legacy):
        inputs = load_inputs(snap, replay_dir, legacy)
        cfg = apply_config({}, inputs.loss, inputs.routing)
        model = build_model(inputs.model, replay_dir, "cpu", Placement(checkpoint_layers=checkpoint))
        ranks = RankInputs(replay_dir, range(inputs.world_size), "cpu", routing_shape(inputs.model))
        counts = step_counts(ranks, cfg, cfg.loss, None, inputs.world_size)
        grad_logprobs = {}
        for rank, saved in ranks.batches.items():
            out = rank_forward(model, ranks, cfg, rank, cfg.needs_entropy)
            out.logprobs.retain_grad()
            result = rank_loss_of(out, saved, rank, cfg, lambda view, b, r=rank: config_loss(view, b, cfg, r, counts))
            result.loss.backward()
            assert out.logprobs.grad is not None
            grad_logprobs[rank] = out.logprobs.grad.detach().clone()
        return grad_logprobs, [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _micro_batched(snap: Path, checkpoint: bool) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """Attribution's gradient pass: micro-batch by micro-batch, one micro-batch's graph at a time."""
    with replay_dir_for(snap) as (replay_dir, legacy):
        inputs = load_inputs(snap, replay_dir, legacy)
        cfg = apply_config({}, inputs.loss, inputs.routing)
        model = build_model(inputs.model, replay_dir, "cpu", Placement(checkpoint_layers=checkpoint))
        ranks = RankInputs(replay_dir, range(inputs.world_size), "cpu", routing_shape(inputs.model))
        passes, _ = _gradient_pass(model, ranks, cfg)
        return (
            {rank: p.grad_logprobs for rank, p in passes.items()},
            [p.grad.detach().clone() for p in model.parameters() if p.grad is not None],
        )


@pytest.mark.parametrize("checkpoint", [False, True])
def test_attributions_gradient_pass_is_the_whole_graphs(snapshot: Path, checkpoint: bool) -> None:
    """dLoss/dlogprobs of every token and the summed gradient, micro-batch by micro-batch (checkpointed or not),
    are the whole graph's."""
    whole_lp, whole_g = _whole_graph(snapshot, False)
    micro_lp, micro_g = _micro_batched(snapshot, checkpoint)
    assert set(micro_lp) == set(whole_lp) == {0, 1}
    for rank in whole_lp:
        assert _rel(micro_lp[rank], whole_lp[rank]) <= SAME, rank
    assert len(micro_g) == len(whole_g)
    for a, b in zip(micro_g, whole_g, strict=True):
        assert _rel(a, b) <= SAME


def test_a_checkpointed_attribution_is_the_plain_one(snapshot: Path) -> None:
    """Every sample's contribution, the router term and the grad norm: the same with the decoder layers
    checkpointed (forward-mode and per-sample backward alike)."""
    plain = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=12), how=How(shard="off")), checkpoint=False
    )
    ckpt = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=12), how=How(shard="off")), checkpoint=True
    )
    naive = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=12, method="per_sample_backward"), how=How(shard="off")),
        checkpoint=True,
    )
    assert plain.total_samples == ckpt.total_samples == 12
    assert _rel(ckpt.grad_norm, plain.grad_norm) <= SAME
    assert abs(ckpt.router_term - plain.router_term) <= SAME * plain.grad_norm
    by_key = {(s.rank, s.sample): s.contribution for s in plain.samples}
    for other in (ckpt, naive):
        for s in other.samples:
            assert abs(s.contribution - by_key[(s.rank, s.sample)]) <= 1e-5 * plain.grad_norm
    assert ckpt.sum_rel_error <= 1e-5


def test_the_loss_channel_micro_batched_and_checkpointed_is_the_whole_graphs(snapshot: Path) -> None:
    """Diagnose's loss channel: its reduced gradient is the whole graph's, and its figures are the same with the
    layers checkpointed."""
    _, whole_g = _whole_graph(snapshot, False)
    expected = math.sqrt(sum(float((g.double() / 2).pow(2).sum()) for g in whole_g))
    plain = step_evidence(snapshot, shard="off", checkpoint=False).channel
    ckpt = step_evidence(snapshot, shard="off", checkpoint=True).channel
    assert plain is not None and ckpt is not None
    assert _rel(plain.grad_norm, expected) <= SAME
    assert plain.sum_rel_error <= SAME
    assert _rel(ckpt.grad_norm, plain.grad_norm) <= SAME
    assert {t.term for t in plain.terms} == {t.term for t in ckpt.terms} >= {"policy", "kl", "entropy", "aux"}
    for a, b in zip(plain.terms, ckpt.terms, strict=True):
        assert a.term == b.term
        assert _rel(b.grad_norm, a.grad_norm) <= SAME, a.term
        assert abs(b.share - a.share) <= SAME, a.term
        for ra, rb in zip(a.ranks, b.ranks, strict=True):
            assert abs(rb.share - ra.share) <= SAME and _rel(rb.grad_norm, ra.grad_norm) <= SAME


def test_checkpointing_runs_under_shard_off_where_the_plan_or_the_request_says(snapshot: Path) -> None:
    """With the whole model in each process (`shard` off), the plan checkpoints the layers when they do not fit
    otherwise, and a request turns it on or off; the grad norm is the same."""
    plain = plan_replay(snapshot, nproc=1, capacity=None, shard="off").chosen
    tight = Capacity("test", "cpu", 1, 1, "a bytes figure no layout fits")
    ckpt = plan_replay(snapshot, nproc=1, capacity=tight, shard="off").chosen
    assert plain is not None and ckpt is not None and ckpt.checkpointed and not plain.checkpointed
    assert ckpt.memory.peak < plain.memory.peak
    between = Capacity("test", "cpu", 1, (ckpt.memory.peak + plain.memory.peak) // 2, "between the two peaks")
    base = run_replay(replay_request(What(snapshot), how=How(nproc=1, shard=Shard.OFF)), checkpoint=False)
    planned = run_replay(replay_request(What(snapshot), how=How(nproc=1, shard=Shard.OFF)), capacity=between)
    asked = run_replay(replay_request(What(snapshot), how=How(nproc=1, shard=Shard.OFF)), checkpoint=True)
    assert "checkpointed" in (planned.shard_reason or "") and "as requested" in (asked.shard_reason or "")
    assert "checkpointed" not in (base.shard_reason or "").replace("not checkpointed", "")
    assert base.grad_norm is not None
    for other in (planned, asked):
        assert _rel(other.grad_norm or 0.0, base.grad_norm) <= SAME


def test_a_checkpointed_sweep_shares_its_forward_and_equals_the_plain_one(snapshot: Path) -> None:
    """A sweep's loss-level configs share one forward per micro-batch; checkpointed, each config's backward
    recomputes the layers (with the first forward's routes) and drops them again: every config's grad norm is the
    plain sweep's, a routing config (its own forward) too."""
    from axrl_spike_replay.replay.sweep import run_sweep

    configs = [{"advantage_clip": 0.5}, {"entropy_coef": 0.0}, {"routing_replay": "off"}]
    plain = run_sweep(
        replay_request(What(snapshot, verb=Verb.SWEEP, configs=tuple(configs)), how=How(nproc=1, shard=Shard.OFF)),
        checkpoint=False,
    )
    ckpt = run_sweep(
        replay_request(What(snapshot, verb=Verb.SWEEP, configs=tuple(configs)), how=How(nproc=1, shard=Shard.OFF)),
        checkpoint=True,
    )
    assert plain.baseline.grad_norm is not None and ckpt.baseline.grad_norm is not None
    assert _rel(ckpt.baseline.grad_norm, plain.baseline.grad_norm) <= SAME
    assert len(plain.results) == len(ckpt.results) == 3
    for a, b in zip(plain.results, ckpt.results, strict=True):
        assert a.grad_norm is not None and b.grad_norm is not None and a.config_id == b.config_id
        assert _rel(b.grad_norm, a.grad_norm) <= SAME, a.config_id
