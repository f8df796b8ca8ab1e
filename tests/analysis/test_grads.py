"""An engineer asks which parameters carried the spike's gradient, per rank and merged across ranks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.analysis.grad_info import top_param_grads
from axrl_spike_replay.errors import SnapshotError


def test_top_parameters_per_rank_and_merged(synthetic, cli) -> None:
    run = cli("grads", synthetic(), "--top", "2", "--json")
    assert run.code == 0
    doc = run.json()
    assert [(p["name"], p["grad_norm"]) for p in doc["merged"]] == [("experts.1.w", 20.0), ("experts.0.w", 10.0)]
    assert "sqrt of the sum over ranks" in doc["merge_method"]
    assert [[p["name"] for p in r["top"]] for r in doc["ranks"]] == [
        ["experts.0.w", "embed.weight"],
        ["experts.1.w", "embed.weight"],
    ]
    assert doc["ranks"][1]["top"][1]["grad_norm"] == 2.0 and doc["ranks"][0]["top"][0]["numel"] == 64
    assert doc["recorded_grad_norm"] == 40.0 and doc["problems"] == []


def test_merged_norm_is_the_root_sum_of_squares_on_the_golden_capture(golden_snapshot: Path) -> None:
    report = top_param_grads(golden_snapshot, top=5)
    infos = [torch.load(golden_snapshot / f"grad_info_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for param in report.merged:
        expected = math.sqrt(sum(float(i["param_grad_norms"][param.name]) ** 2 for i in infos))
        assert param.grad_norm == pytest.approx(expected)
    merged_all = {
        name: math.sqrt(sum(float(i["param_grad_norms"][name]) ** 2 for i in infos))
        for name in infos[0]["param_grad_norms"]
    }
    assert [p.name for p in report.merged] == sorted(merged_all, key=lambda n: -merged_all[n])[:5]
    assert all(r.recorded_global_grad_norm == pytest.approx(report.recorded_grad_norm, rel=1e-3) for r in report.ranks)
    for rank, info in zip(report.ranks, infos, strict=True):  # each rank's own share, not the global norm
        local = math.sqrt(sum(float(v) ** 2 for v in info["param_grad_norms"].values()))
        assert rank.local_grad_norm == pytest.approx(local)
        assert rank.local_grad_norm != pytest.approx(report.recorded_grad_norm, rel=1e-3)


def test_readable_summary_and_missing_files(synthetic, tmp_path: Path, cli) -> None:
    out = cli("grads", synthetic()).out
    assert out.splitlines()[0] == "iteration 42: recorded grad norm 40"
    assert "experts.1.w" in out and "rank 1: local grad norm 20.11, loss 0.2" in out
    empty = tmp_path / "iter_0000001"
    empty.mkdir()
    (empty / "axrl_metadata.json").write_text('{"iteration": 1, "grad_norm": 1.0, "median_norm": 1.0}')
    with pytest.raises(SnapshotError, match=r"no grad_info_rank<r>\.pt files"):
        top_param_grads(empty)
