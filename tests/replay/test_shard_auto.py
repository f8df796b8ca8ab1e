"""`shard: auto` decides from the replay plan: the same per-process prediction `plan` prints, made against the
memory where the processes run (this machine's, a probed node's GPUs, or none known), and says why.

The fixture is the tiny MoE saved at world size 2; the memory is stated as the plan's own `Capacity`."""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.replay.plans.replay_plan import Capacity, plan_replay
from axrl_spike_replay.replay.plans.shard_choice import choose_shard, planned_shard

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
SNAPSHOT = FIXTURE / "checkpoints" / "spike_snapshots" / "iter_0000021"  # tiny MoE, saved world size 2


def _whole_row(nproc: int, capacity: Capacity, device: str = "cpu"):
    """The smallest whole-model row: with the decoder layers checkpointed (tried last, so chosen where nothing whole
    fits `capacity`)."""
    row = plan_replay(SNAPSHOT, nproc=nproc, device=device, capacity=capacity, shard="off").chosen
    assert row is not None and not row.sharded and row.checkpointed
    return row


def test_a_machine_the_whole_model_does_not_fit_shards_and_one_it_fits_stays_whole() -> None:
    need = _whole_row(2, Capacity("none", "cpu", 1, 1, "test")).per_device  # two whole processes here, at least
    tight = Capacity("a small machine", "cpu", 1, need - 1, "test")
    plan = planned_shard(str(SNAPSHOT), 2, "cpu", 1, capacity=tight)
    assert plan is not None and plan.whole is not None and plan.whole.fits is False
    choice = choose_shard("auto", "cpu", 2, plan)
    assert choice.shard is True
    assert choice.reason.startswith("shard auto: the replay plan's whole-model peak")
    assert f"{plan.whole.memory.peak / (1 << 30):.2f} GiB per process" in choice.reason  # the figure the plan prints
    assert "does not fit" in choice.reason and "a small machine" in choice.reason and "FSDP2 over 2" in choice.reason

    roomy = Capacity("a large machine", "cpu", 1, need, "test")
    choice = choose_shard("auto", "cpu", 2, planned_shard(str(SNAPSHOT), 2, "cpu", 1, capacity=roomy))
    assert choice.shard is False and "fits (" in choice.reason and "whole model in each process" in choice.reason


def test_a_probed_node_s_gpus_decide_for_processes_launched_there() -> None:
    whole = _whole_row(2, Capacity("gpu-node", "cuda", 1, 1, "test"), "cuda")
    # two nodes of one GPU each: one process per GPU, the whole model's step over a GPU's memory
    small = Capacity("gpu-node", "cuda", 1, whole.memory.step - 1, "nvidia-smi on the node")
    plan = planned_shard(str(SNAPSHOT), 2, "cuda", 1, capacity=small, nodes=2)
    assert plan is not None and plan.chosen is not None and plan.chosen.sharded
    choice = choose_shard("auto", "cuda", 2, plan)
    assert choice.shard is True and "on gpu-node" in choice.reason
    big = Capacity("gpu-node", "cuda", 1, whole.memory.step, "nvidia-smi on the node")
    plan = planned_shard(str(SNAPSHOT), 2, "cuda", 1, capacity=big, nodes=2)
    assert choose_shard("auto", "cuda", 2, plan).shard is False


def test_unknown_memory_or_one_process_stays_whole_and_says_why() -> None:
    unknown = choose_shard("auto", "cpu", 2, planned_shard(str(SNAPSHOT), 2, "cpu", 1, capacity=None))
    assert unknown.shard is False and "cannot be judged (capacity unknown)" in unknown.reason
    tiny = Capacity("a tiny machine", "cpu", 1, 1 << 10, "test")
    one = choose_shard("auto", "cpu", 1, planned_shard(str(SNAPSHOT), 1, "cpu", 1, capacity=tiny))
    assert one.shard is False and "does not fit" in one.reason and "one process gains nothing" in one.reason
    unread = choose_shard("auto", "cpu", 2, planned_shard(str(FIXTURE / "no-such-snapshot"), 2, "cpu", 1))
    assert unread.shard is False and "no replay plan could be made" in unread.reason


def test_on_and_off_are_taken_as_asked() -> None:
    assert choose_shard("on", "cpu", 2).shard is True
    assert choose_shard("off", "cpu", 2).reason == "shard off: every process holds the whole model"
