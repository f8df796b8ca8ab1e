"""The replay's own per-parameter grad norms are held to the recorded ones: a tampered batch whose recorded global
norm was edited to the replay's no longer passes as reproduced and self-consistent; an honest snapshot passes at
full and at reduced fidelity; FSDP's shards of the reduced gradient are merged before they are compared."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.snapshot.consistency import Consistency
from axrl_spike_replay.snapshot.replayed_param_norms import check_replayed_param_norms, plain_name
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot


def _edit(path: Path, change: Callable[[dict], None]) -> None:
    doc = torch.load(path, weights_only=True)
    change(doc)
    torch.save(doc, path)


def _record_as_if_trained(snapshot: Path, grad_norm: float, losses: dict[int, float]) -> None:
    """What a careful forger does after editing the batch: the replay's global norm and per-rank losses written
    everywhere, and every recorded per-parameter norm scaled with the global norm (so that it still lies within
    their triangle bounds)."""
    meta_path = snapshot / "axrl_metadata.json"
    meta = json.loads(meta_path.read_text())
    scale = grad_norm / meta["grad_norm"]
    meta.update(grad_norm=grad_norm, spike_ratio=grad_norm / meta["median_norm"])
    meta_path.write_text(json.dumps(meta))
    for rank in (0, 1):

        def forge(info: dict) -> None:
            info["grad_norm"], info["loss"] = grad_norm, losses[rank]  # noqa: B023 - used at once
            info["param_grad_norms"] = {k: v * scale for k, v in info["param_grad_norms"].items()}

        _edit(snapshot / f"grad_info_rank{rank}.pt", forge)
    for log in snapshot.parents[2].glob("logs/*.log"):
        log.unlink()  # the forger's job has no log to contradict it


@pytest.mark.parametrize("nproc", [1, 2], ids=["reduced", "full"])
def test_an_honest_snapshot_matches_parameter_by_parameter(
    spike_snapshot: Path, nproc: int, warm_runner: JobRunner
) -> None:
    result = run_replay(replay_request(What(spike_snapshot), how=How(nproc=nproc)), runner=warm_runner)
    assert result.verdict == "reproduced"
    assert result.consistency is not None and "param_grad_norms_vs_replay" in result.consistency.checked
    assert result.consistency.self_consistent, result.consistency.problems


def test_a_tampered_advantage_with_forged_norms_is_a_named_problem(snapshot_copy: Callable[[], Path]) -> None:
    snap = snapshot_copy()
    _edit(snap / "batch_rank0.pt", lambda b: b["advantages"].__setitem__(1, b["advantages"][1] * 3.0))
    tampered = run_replay(replay_request(What(snap), how=How(nproc=1)))
    _record_as_if_trained(snap, tampered.grad_norm, {m["rank"]: m["loss"] for m in tampered.rank_metrics})

    result = run_replay(replay_request(What(snap), how=How(nproc=1)))

    assert result.verdict == "reproduced"  # the global norm alone is fooled, and the static checks pass
    consistency = result.consistency
    assert consistency is not None and not consistency.self_consistent
    problems = [p for p in consistency.problems if p.name == "param_grad_norms_vs_replay"]
    assert [p.figures["rank"] for p in problems] == [0, 1]  # rank 1's batch is honest, its norms are forged
    assert [p.name for p in consistency.problems] == ["param_grad_norms_vs_replay"] * 2
    assert (
        "rank 0's recorded per-parameter grad norms (before the data-parallel mean) differ from those the replay"
        in (problems[0].message)
    )
    assert problems[0].figures["differing"] > problems[0].figures["compared"] // 2


def test_one_edited_parameter_norm_is_named(snapshot_copy: Callable[[], Path]) -> None:
    snap = snapshot_copy()
    _edit(
        snap / "grad_info_rank1.pt",
        lambda i: i["param_grad_norms"].__setitem__("head.weight", i["param_grad_norms"]["head.weight"] * 1.01),
    )
    consistency = run_replay(replay_request(What(snap), how=How(nproc=1))).consistency
    assert consistency is not None
    [problem] = consistency.problems
    assert problem.figures["differing"] == 1 and problem.figures["worst"][0]["name"] == "head.weight"


def _with_norms(tmp_path: Path, norms: dict[int, dict[str, float]], kind: str | None) -> Path:
    snapshot = write_synthetic_snapshot(tmp_path, SyntheticSpec(world_size=2))
    for rank, values in norms.items():
        info = {"grad_norm": 40.0, "param_grad_norms": values}
        if kind:
            info["param_grad_norms_kind"] = kind
        torch.save(info, snapshot / f"grad_info_rank{rank}.pt")
    return snapshot


def test_fsdp_shards_are_merged_and_a_reduced_sum_may_round_within_the_whole(tmp_path: Path) -> None:
    shards = {0: {"w": 24.0, "_fsdp_wrapped_module.v": 3e-9}, 1: {"w": 32.0, "_fsdp_wrapped_module.v": 4e-9}}
    snapshot = _with_norms(tmp_path, shards, "reduced_shard")
    # v's reduced gradient nearly cancels: summed in another order it differs by 20 % of itself, 1e-10 of the whole
    replayed = {"w": 40.0, "v": 6e-9}
    out = check_replayed_param_norms(Consistency(), snapshot, replayed, None, 1e-5, "the replay")
    assert out.checked == ["param_grad_norms_vs_replay"] and out.self_consistent
    out = check_replayed_param_norms(Consistency(), snapshot, {"w": 40.1, "v": 5e-9}, None, 1e-5, "the replay")
    [problem] = out.problems
    assert "(of the reduced gradient) differ from those the replay computes in 1 of 2 parameters" in problem.message


def test_local_norms_are_compared_rank_by_rank_and_unknown_names_are_not_a_check(tmp_path: Path) -> None:
    local = {0: {"w": 3.0, "u": 1.0}, 1: {"w": 4.0, "u": 1.0}}
    snapshot = _with_norms(tmp_path, local, None)
    out = check_replayed_param_norms(Consistency(), snapshot, {"w": 3.5, "u": 1.0}, local, 1e-6, "the replay")
    assert out.self_consistent and "param_grad_norms_vs_replay" in out.checked
    swapped = {0: local[1], 1: local[0]}
    out = check_replayed_param_norms(Consistency(), snapshot, {"w": 3.5, "u": 1.0}, swapped, 1e-6, "the replay")
    assert [p.figures["rank"] for p in out.problems] == [0, 1]
    flat = {0: {"_flat_param": 3.0}, 1: {"_flat_param": 4.0}}
    out = check_replayed_param_norms(Consistency(), snapshot, {"w": 3.5}, flat, 1e-6, "the replay")
    assert out.checked == [] and out.self_consistent  # nothing comparable: not claimed as checked


def test_wrapper_segments_are_dropped_from_names() -> None:
    assert plain_name("_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.w") == "model.layers.0.mlp.w"
    assert plain_name("module._orig_mod.head.weight") == "head.weight"
