"""The plan's streamed row chooses how its processes split the work, and the replay follows it: the saved ranks
(each process one block of them and a whole layer at a time) where a whole layer fits each device, each MoE layer's
routed experts (`expert_share`) where it does not and 1/N of the experts does, neither where even that does not.

On paper: config-only snapshots of published MoE configs planned for a described node of 8 GPUs. In a run: the tiny
snapshot recorded in this test, replayed streamed over 2 gloo processes against a capacity the library is given (the
engine's `capacity`), between the two splits' figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.cli import main
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.plans.replay_plan import GIB, Capacity, plan_replay
from axrl_spike_replay.replay.plans.shard_choice import choose_shard, planned_shard
from axrl_spike_replay.testing.config_only_snapshot import (
    DEEPSEEK_V3,
    QWEN3_CODER_480B_A35B,
    write_config_only_snapshot,
)
from axrl_spike_replay.vocabulary import Shard


def node(gib: float) -> Capacity:
    """8 GPUs of `gib` GiB, as `plan --gpus 8 --gpu-memory GIB` describes them (92% usable)."""
    return Capacity("the node described", "cuda", 8, int(gib * GIB * 0.92), "test")


def test_qwen3_coder_480b_splits_its_experts_on_8_gpus_of_48_gib_and_its_saved_ranks_on_8xh200(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    coder = QWEN3_CODER_480B_A35B
    snap = write_config_only_snapshot(tmp_path / "q", "qwen3_moe", coder, world_size=8, batch=1, seq=1024)
    small = plan_replay(snap, nproc=8, device="cuda", capacity=node(48), shard="streamed").streamed
    assert small is not None and small.split == "experts" and small.fits and small.processes == 8
    # a whole MoE layer (160 experts) with its gradient copies is over a 44 GiB device; 20 experts of it are not
    assert small.ranks_peak > node(48).bytes_each >= small.experts_peak == small.device_peak
    assert small.ranks_peak > 3 * small.experts_peak and small.ranks_each == 8  # every saved rank in each process
    assert "each every saved rank and 1/8 of each MoE layer's routed experts" in small.text()
    assert "the experts split chosen" in small.text()
    large = plan_replay(snap, nproc=8, device="cuda", capacity=node(140), shard="streamed").streamed
    assert large is not None and large.split == "ranks" and large.fits and large.ranks_each == 1
    assert large.device_peak == large.ranks_peak and large.experts_peak == small.experts_peak
    assert "the saved-ranks split chosen" in large.text()
    # the plan verb says both figures and the choice, as text and as JSON (no new argument)
    args = ["plan", str(snap), "--gpus", "8", "--gpu-memory", "48", "--shard", "streamed", "--nproc", "8"]
    assert main([*args, "--workspace", str(tmp_path)]) == 0
    assert "the experts split chosen" in capsys.readouterr().out
    assert main([*args, "--workspace", str(tmp_path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["streamed"]
    assert row["split"] == "experts" and row["ranks_peak"] == small.ranks_peak
    assert row["experts_peak"] == small.experts_peak and row["experts_refused"] == ""
    choice = choose_shard("streamed", "cuda", 8, plan_replay(snap, nproc=8, device="cuda", capacity=node(48)))
    assert choice.streamed and choice.experts and "routed experts split over the 8 processes" in choice.reason


def test_shard_auto_without_nproc_plans_the_streamed_row_of_the_one_process_it_would_stream_in(tmp_path: Path) -> None:
    """A replay without `nproc` streams in one process; under `shard auto` its plan's streamed row is that process's,
    not the saved world size's: an expert split over 8 processes it would not start is never its reason."""
    coder = QWEN3_CODER_480B_A35B
    snap = write_config_only_snapshot(tmp_path / "q", "qwen3_moe", coder, world_size=8, batch=1, seq=1024)
    alone = planned_shard(str(snap), None, "cuda", 1, capacity=node(48))
    assert alone is not None and alone.streamed is not None and alone.chosen is not None
    assert alone.streamed.processes == 1 and alone.streamed.split == "ranks" and alone.chosen.nproc == 8
    assert "routed experts" not in choose_shard("auto", "cuda", 8, alone).reason
    eight = planned_shard(str(snap), 8, "cuda", 1, capacity=node(48))  # `nproc` 8: the split it would run
    assert eight is not None and eight.streamed is not None
    assert eight.streamed.processes == 8 and eight.streamed.split == "experts"


def test_deepseek_v3_says_why_its_experts_do_not_split_and_keeps_the_saved_ranks(tmp_path: Path) -> None:
    snap = write_config_only_snapshot(tmp_path / "ds", "deepseek_v3", DEEPSEEK_V3, world_size=8, batch=1, seq=1024)
    h100 = plan_replay(snap, nproc=8, device="cuda", capacity=node(80), shard="streamed")
    row = h100.streamed
    assert row is not None and row.split == "ranks" and row.fits is False
    # 1/8 of its 256 experts would fit an H100; the split is built for tiny_moe, qwen2_moe and qwen3_moe only
    assert row.experts_peak < node(80).bytes_each < row.ranks_peak == row.device_peak
    assert "not deepseek_v3" in row.experts_refused and "neither fits" in row.text()
    assert not choose_shard("streamed", "cuda", 8, h100).experts
    h200 = plan_replay(snap, nproc=8, device="cuda", capacity=node(140), shard="streamed").streamed
    assert h200 is not None and h200.split == "ranks" and h200.fits and "the saved-ranks split chosen" in h200.text()


def test_a_replay_whose_layer_does_not_fit_a_process_splits_its_experts_as_planned(tmp_path: Path) -> None:
    """On CPU the 2 processes share the host: a capacity of twice a process's figure. Below the saved-ranks split's
    peak (even without the layer read ahead) and above the experts split's, the replay splits the experts, and its
    figures are the one-process streamed replay's (1e-6)."""
    snapshot = record_tiny_snapshot(tmp_path / "snap", world_size=2)
    roomy = plan_replay(snapshot, nproc=2, capacity=Capacity("here", "cpu", 1, 8 << 30, "t"), shard="streamed")
    row = roomy.streamed
    assert row is not None and row.split == "ranks" and row.read_ahead
    without_read_ahead = row.ranks_peak - row.layer // 5  # the layer's parameters and gradients, and one read ahead
    tight = Capacity("a tight machine", "cpu", 1, 2 * (without_read_ahead - 1), "t")
    planned = plan_replay(snapshot, nproc=2, capacity=tight, shard="streamed").streamed
    assert planned is not None and planned.split == "experts" and planned.fits
    one = run_replay(replay_request(What(snapshot), how=How(shard=Shard.STREAMED)))
    split = run_replay(replay_request(What(snapshot), how=How(nproc=2, shard=Shard.STREAMED)), capacity=tight)
    assert "routed experts split over the 2 processes" in split.shard_reason
    assert split.grad_norm == pytest.approx(one.grad_norm, rel=1e-6) and split.verdict == one.verdict
    kept = run_replay(replay_request(What(snapshot), how=How(nproc=2, shard=Shard.STREAMED)))
    assert "routed experts" not in kept.shard_reason  # a layer fits each process here: the saved ranks split
    assert kept.grad_norm == one.grad_norm  # the saved-ranks split: bit for bit
