"""Each static consistency check fires, alone and by name, on a copy of the golden snapshot edited by hand in the
one place it compares; the unedited snapshot passes them all."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.snapshot.consistency import check_snapshot
from axrl_spike_replay.snapshot.inspect import inspect_snapshot

RECORDED = 56.77506102151846  # the golden snapshot's recorded grad norm
MEDIAN = 0.37807251730432034
STATIC_CHECKS = [
    "spike_ratio_vs_norms",
    "ranks_vs_files",
    "metadata_vs_run_config",
    "rank_grad_norm_vs_metadata",
    "grad_norm_vs_param_norms",
]


def _edit_metadata(snapshot: Path, **changes: object) -> None:
    path = snapshot / "axrl_metadata.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_grad_info(snapshot: Path, rank: int, edit: Callable[[dict], None]) -> None:
    path = snapshot / f"grad_info_rank{rank}.pt"
    info = torch.load(path, weights_only=True)
    edit(info)
    torch.save(info, path)


def _spike_ratio(snapshot: Path) -> None:
    _edit_metadata(snapshot, spike_ratio=100.0)  # grad_norm / median_norm is 150.17


def _run_config(snapshot: Path) -> None:
    path = snapshot / "run_config.yaml"
    text = path.read_text()
    assert text.count("\n  dp: 2\n") == 1
    path.write_text(text.replace("\n  dp: 2\n", "\n  dp: 4\n"))


def _rank_grad_norm(snapshot: Path) -> None:
    _edit_grad_info(snapshot, 1, lambda info: info.update(grad_norm=60.0))


def _param_norms(snapshot: Path) -> None:
    for rank in (0, 1):  # every per-parameter norm a tenth of what it was: the recorded norm is out of their bound
        _edit_grad_info(rank=rank, snapshot=snapshot, edit=lambda i: i.update(
            param_grad_norms={k: 0.1 * v for k, v in i["param_grad_norms"].items()}))  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "name", "message", "figures"),
    [
        (
            _spike_ratio,
            "spike_ratio_vs_norms",
            f"spike ratio 100 but grad_norm / median_norm = {RECORDED / MEDIAN:.6g}",
            {"spike_ratio": 100.0},
        ),
        (
            _run_config,
            "metadata_vs_run_config",
            "parallel.dp is 2 in the metadata but 4 in run_config.yaml",
            {"key": "dp", "metadata": 2, "run_config": 4},
        ),
        (
            _rank_grad_norm,
            "rank_grad_norm_vs_metadata",
            f"rank 1 recorded grad norm 60, the metadata {RECORDED:.6g}",
            {"rank": 1, "rank_grad_norm": 60.0},
        ),
        (
            _param_norms,
            "grad_norm_vs_param_norms",
            f"recorded global grad norm {RECORDED:.6g} contradicts the recorded per-parameter norms",
            {"recorded_grad_norm": RECORDED},
        ),
    ],
)
def test_each_check_fires_alone_on_the_field_it_compares(
    golden_snapshot: Path, tmp_path: Path, edit: Callable[[Path], None], name: str, message: str, figures: dict
) -> None:
    assert check_snapshot(golden_snapshot).problems == []  # the unedited snapshot agrees with itself
    snapshot = tmp_path / golden_snapshot.name
    shutil.copytree(golden_snapshot, snapshot)
    edit(snapshot)
    result = check_snapshot(snapshot)
    assert result.checked == STATIC_CHECKS
    (problem,) = result.problems
    assert problem.name == name and problem.message.startswith(message)
    assert figures.items() <= problem.figures.items()
    assert result.self_consistent is False and result.summary().startswith("snapshot 1 self-inconsistencies")
    shown = inspect_snapshot(snapshot).consistency  # what `inspect` reports
    assert shown is not None and [(p.name, p.message) for p in shown.problems] == [(name, problem.message)]


def test_the_param_norm_bound_is_named_with_its_numbers(golden_snapshot: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / golden_snapshot.name
    shutil.copytree(golden_snapshot, snapshot)
    low, high = check_snapshot(snapshot).merged_param_norm_bounds or [0.0, 0.0]
    assert low < RECORDED < high
    _param_norms(snapshot)
    result = check_snapshot(snapshot)
    assert result.merged_param_norm_bounds == pytest.approx([0.1 * low, 0.1 * high])
    (problem,) = result.problems
    assert f"it must lie in [{0.1 * low:.6g}, {0.1 * high:.6g}]" in problem.message


@pytest.mark.parametrize(("gap", "flagged"), [(7e-4, True), (2e-6, False)])
def test_norms_merged_from_the_reduced_gradient_are_held_to_their_own_tolerance(
    golden_snapshot: Path, tmp_path: Path, gap: float, flagged: bool
) -> None:
    """Per-parameter norms of the reduced gradient, as the Megatron hook merges them over its TP, EP and PP shards:
    a shard missed or counted twice moves their sum by far more than float32 summation does (a 7e-4 gap passed the
    local norms' 1e-3 tolerance); float32 rounding of the trainer's own norm stays well inside."""
    snapshot = tmp_path / golden_snapshot.name
    shutil.copytree(golden_snapshot, snapshot)
    norms = torch.load(snapshot / "grad_info_rank0.pt", weights_only=True)["param_grad_norms"]
    scale = RECORDED / (1 + gap) / sum(v * v for v in norms.values()) ** 0.5
    reduced = {k: v * scale for k, v in norms.items()}
    for rank in (0, 1):
        _edit_grad_info(snapshot, rank, lambda i: i.update(param_grad_norms=reduced, param_grad_norms_kind="reduced"))
    problems = [p for p in check_snapshot(snapshot).problems if p.name == "grad_norm_vs_param_norms"]
    assert bool(problems) is flagged
    if flagged:
        assert "relative tolerance 1e-05" in problems[0].message and problems[0].figures["tolerance"] == 1e-5


def test_a_check_not_made_is_named_with_why(golden_snapshot: Path, tmp_path: Path) -> None:
    """Runs make different sets of checks (no log value here, no replay): the line names each made and each not made,
    with the reason, so that one run's "6 checks" and another's "8" can be told apart."""
    snapshot = tmp_path / golden_snapshot.name
    shutil.copytree(golden_snapshot, snapshot)
    (snapshot / "run_config.yaml").unlink()
    _edit_grad_info(snapshot, 1, lambda info: info.update(param_grad_norms={}))
    result = check_snapshot(snapshot, log_note="no log file beside the snapshot")
    assert result.checked == ["spike_ratio_vs_norms", "ranks_vs_files", "rank_grad_norm_vs_metadata"]
    assert result.skipped == {
        "metadata_vs_run_config": "no run_config.yaml",
        "grad_norm_vs_param_norms": "needs every data-parallel rank's per-parameter norms: 1 of 2 grad info file(s) "
        "hold them, data-parallel size 2",
        "grad_norm_vs_log": "no log file beside the snapshot",
    }
    assert result.summary() == (
        "snapshot agrees with itself; no log value (3 checks: spike_ratio_vs_norms, ranks_vs_files, "
        "rank_grad_norm_vs_metadata; not made: metadata_vs_run_config: no run_config.yaml; grad_norm_vs_param_norms: "
        "needs every data-parallel rank's per-parameter norms: 1 of 2 grad info file(s) hold them, data-parallel size "
        "2; grad_norm_vs_log: no log file beside the snapshot; rank_loss_vs_replay, param_grad_norms_vs_replay: made "
        "by `replay` (against the step it replays); grad_norm_vs_replay: made by `diagnose` with model evidence (a "
        "replay judges the global norm in its verdict))"
    )
