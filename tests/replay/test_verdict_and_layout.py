"""Verdicts and replay layouts, from their definitions."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from axrl_spike_replay.cli import main
from axrl_spike_replay.errors import AxrlError, ConfigError, SnapshotError
from axrl_spike_replay.experiment.verdict import (
    baseline_verdict,
    mitigation_verdict,
    ratio_threshold,
    tolerance,
    writable_problem,
)
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.replay.plans.layout_plan import plan_layout
from axrl_spike_replay.snapshot.metadata import DetectorSpec
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.task_record.task_state import show_task


def test_baseline_is_reproduced_within_the_layouts_tolerance() -> None:
    assert tolerance("full") == 1e-6 and tolerance("reduced") == 1e-5
    assert tolerance("full", "cuda") > tolerance("reduced")
    assert baseline_verdict(10.0 * (1 + 9e-7), 10.0, tolerance("full")) == "reproduced"
    assert baseline_verdict(10.0 * (1 + 2e-6), 10.0, tolerance("full")) == "not_reproduced"
    assert baseline_verdict(10.0 * (1 + 2e-6), 10.0, tolerance("reduced")) == "reproduced"
    assert baseline_verdict(math.inf, math.inf, 1e-6) == "reproduced"
    assert baseline_verdict(math.nan, 10.0, 1e-6) == "not_reproduced"


@pytest.mark.parametrize(
    ("grad_norm", "verdict"),
    [
        (4.9, "cleared"),  # ratio 4.9 < threshold 5 (median 1)
        (5.0, "partial"),  # at the threshold, half the baseline's 10
        (7.0, "no_effect"),
        (10.4, "no_effect"),
        (11.0, "worse"),
        (math.inf, "worse"),
    ],
)
def test_mitigation_verdict_against_the_baseline(grad_norm: float, verdict: str) -> None:
    assert mitigation_verdict(grad_norm, baseline_grad_norm=10.0, median_norm=1.0, threshold=5.0) == verdict


def test_threshold_comes_from_a_median_ratio_detector() -> None:
    assert ratio_threshold(DetectorSpec(kind="median_ratio", threshold=3.0)) == 3.0
    assert ratio_threshold(DetectorSpec(kind="zscore", threshold=6.0)) == 5.0


def test_layouts_full_reduced_and_uneven() -> None:
    full = plan_layout(4)
    assert full.fidelity == "full" and full.assignment == ((0,), (1,), (2,), (3,))
    reduced = plan_layout(4, 1)
    # one process replaying every saved rank in turn: still every saved rank, the same DP mean (full fidelity)
    assert reduced.fidelity == "full" and reduced.assignment == ((0, 1, 2, 3),) and reduced.ranks_per_process == 4
    assert plan_layout(3, 2).assignment == ((0,), (1, 2))
    with pytest.raises(ConfigError, match="larger than the saved world size 2"):
        plan_layout(2, 3)
    with pytest.raises(ConfigError, match=">= 1"):
        plan_layout(2, 0)


@pytest.mark.parametrize(
    ("grad_norm", "baseline", "verdict"),
    [
        (3.0, 4.0, "baseline_not_a_spike"),  # the baseline's ratio 4 is under the threshold 5: nothing to clear
        (4.0, 4.0, "baseline_not_a_spike"),  # a no-op on a non-spike is not `cleared`
        (5.0, 4.0, "worse"),  # growing is still reported
        (9.95, 10.0, "no_effect"),  # 0.5% lower: not measurably below the spike
        (10.0, 10.0, "no_effect"),
        (math.inf, math.inf, "no_effect"),
        (4.0, math.inf, "cleared"),  # a non-finite baseline is a spike; a finite norm under the bar clears it
        (9.0, math.inf, "partial"),
    ],
)
def test_a_mitigation_is_judged_only_against_a_baseline_that_is_a_spike(
    grad_norm: float, baseline: float, verdict: str
) -> None:
    assert mitigation_verdict(grad_norm, baseline_grad_norm=baseline, median_norm=1.0, threshold=5.0) == verdict


def test_a_median_that_is_not_positive_counts_as_a_spike_like_the_detector() -> None:
    assert mitigation_verdict(4.0, baseline_grad_norm=10.0, median_norm=0.0, threshold=5.0) == "partial"
    assert mitigation_verdict(10.0, baseline_grad_norm=10.0, median_norm=0.0, threshold=5.0) == "no_effect"


def test_zscore_snapshots_are_judged_against_the_ratio_bar_with_the_same_baseline_check() -> None:
    bar = ratio_threshold(DetectorSpec(kind="zscore", threshold=1000.0))  # a raised z threshold changes nothing
    assert bar == 5.0
    assert mitigation_verdict(150.0, baseline_grad_norm=150.0, median_norm=1.0, threshold=bar) == "no_effect"
    assert mitigation_verdict(1.1, baseline_grad_norm=1.2, median_norm=1.0, threshold=bar) == "baseline_not_a_spike"


@pytest.mark.parametrize("threshold", [math.nan, math.inf, -1.0, 0.0, "1000", True])
def test_a_median_ratio_threshold_that_is_not_a_positive_number_is_refused(threshold: object) -> None:
    with pytest.raises(SnapshotError, match=r"detector threshold .* is not a finite number > 0"):
        ratio_threshold(DetectorSpec(kind="median_ratio", threshold=threshold))  # type: ignore[arg-type]


def test_writing_up_rechecks_the_figures_not_only_the_stored_verdict() -> None:
    assert writable_problem("cleared", 3.0, 40.0, 1.0, 5.0) is None
    assert "verdict is 'no_effect'" in (writable_problem("no_effect", 40.0, 40.0, 1.0, 5.0) or "")
    assert "baseline was not a spike" in (writable_problem("cleared", 3.0, 4.0, 1.0, 5.0) or "")
    assert "not measurably below" in (writable_problem("cleared", 40.0, 40.0, 1.0, 5.0) or "")
    assert "no baseline grad norm" in (writable_problem("partial", 3.0, None, 1.0, 5.0) or "")


def _with_detector(snapshot: Path, **detector: object) -> Path:
    meta_path = snapshot / "axrl_metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["detector"].update(detector)
    meta_path.write_text(json.dumps(meta))
    return snapshot


def test_a_no_op_on_a_snapshot_whose_threshold_was_raised_is_not_a_method(
    snapshot_copy: Callable[[], Path], workspace: Path, capsys: pytest.CaptureFixture[str], warm_runner: JobRunner
) -> None:
    """The issue's case: detector.threshold raised to 1000, clip_eps_low=0.2 (the saved value: +0.0%)."""
    snapshot = _with_detector(snapshot_copy(), threshold=1000)
    open_task(workspace, "fixture-moe", snapshot)

    request = replay_request(What(snapshot, mitigations={"clip_eps_low": 0.2}), workspace=workspace)
    result = run_request(request, warm_runner)

    assert result.fidelity == "full" and result.change_vs_baseline == 0.0
    assert result.threshold == 1000 and result.spike_ratio is not None and result.spike_ratio < 1000
    assert result.verdict == "baseline_not_a_spike"
    on_disk = Path(result.output_dir) / "replay_result.json"
    assert json.loads(on_disk.read_text())["verdict"] == "baseline_not_a_spike"
    (row,) = show_task(workspace, "fixture-moe").experiments
    assert row.verdict == "baseline_not_a_spike"
    assert "baseline is not a spike" in (Path(result.output_dir) / "replay.log").read_text()

    with pytest.raises(AxrlError, match="verdict 'baseline_not_a_spike'"):
        add_method(workspace, "fixture-moe", row.id, "clip-low", "it cleared the spike")
    # A result written before this check, claiming `cleared`, is refused on its figures.
    doc = json.loads(on_disk.read_text())
    on_disk.write_text(json.dumps({**doc, "verdict": "cleared"}))
    argv = ["method", "add", "--job", "fixture-moe", "--attempt", row.id, "--name", "clip-low"]
    status = main([*argv, "--rationale", "it cleared the spike", "--workspace", str(workspace)])
    err = capsys.readouterr().err
    assert status == 2 and "baseline was not a spike" in err and "Traceback" not in err
    assert not (workspace / "spike-mitigation-methods" / "clip-low.md").exists()


def test_a_no_op_on_a_real_spike_stays_no_effect_whatever_the_zscore_threshold(
    snapshot_copy: Callable[[], Path],
) -> None:
    snapshot = _with_detector(snapshot_copy(), kind="zscore", threshold=1000)
    result = run_replay(replay_request(What(snapshot, mitigations={"clip_eps_low": 0.2}), how=How(nproc=1)))
    assert result.threshold == 5.0 and result.change_vs_baseline == 0.0
    assert result.verdict == "no_effect"
