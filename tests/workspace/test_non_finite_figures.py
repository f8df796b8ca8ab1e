"""A replay whose grad norm overflowed: the result file, the task record and `--json` all say null, and are
strict JSON; a task written before (figures spelled "inf" / "nan") still reads back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from record_helpers import JOB, MEDIAN, THRESHOLD, SpikeRun, replay_result

from axrl_spike_replay.cli import main
from axrl_spike_replay.experiment.verdict import verdict_basis
from axrl_spike_replay.investigation.recording import new_run_dir
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.task_record.evidence import row_result
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.task_log import record_replay
from axrl_spike_replay.workspace.task_record.task_state import read_state


def strict_json(text: str) -> object:
    """JSON as the standard has it: NaN and Infinity are refused."""

    def refuse(constant: str) -> object:
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_an_overflowed_replay_is_null_in_the_result_file_the_task_and_json(
    tmp_path: Path, spike_run: SpikeRun, capsys: pytest.CaptureFixture[str]
) -> None:
    open_task(tmp_path, JOB, spike_run.snapshot)
    result = replay_result(
        spike_run.snapshot,
        math.inf,
        "worse",
        mitigations={"advantage_clip": 1.0},
        rel_diff=math.inf,
        spike_ratio=math.nan,
        baseline_grad_norm=37.0,
        change_vs_baseline=math.inf,
    )
    run = new_run_dir(tmp_path, JOB)
    path = run.write_result(result)
    assert path is not None
    doc = strict_json(path.read_text())
    assert doc["grad_norm"] is None and doc["spike_ratio"] is None and doc["verdict"] == "worse"

    assert record_replay(tmp_path, JOB, result, path) == "E1"
    [row] = read_state(tmp_path, JOB).experiments
    assert row.grad_norm is None and row.rel_diff is None and row.change_vs_baseline is None
    assert row.baseline_grad_norm == 37.0

    assert main(["task", "show", JOB, "--workspace", str(tmp_path), "--json"]) == 0
    shown = strict_json(capsys.readouterr().out)
    assert shown["experiments"][0]["grad_norm"] is None  # type: ignore[index]


def test_every_non_finite_float_becomes_null_wherever_it_sits() -> None:
    doc = {"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": (2, Path("/x")), 3: {"d": float("nan")}}
    assert to_jsonable(doc) == {"a": None, "b": [None, None, 1.5], "c": [2, "/x"], "3": {"d": None}}


def test_a_task_row_written_with_spelled_out_figures_still_reads_back(spike_run: SpikeRun) -> None:
    row = {
        "id": "E4",
        "snapshot": str(spike_run.snapshot),
        "backend": "torch",
        "target": "local",
        "fidelity": "full",
        "verdict": "worse",
        "grad_norm": "inf",
        "recorded_grad_norm": 37.42,
        "rel_diff": "nan",
        "median_norm": 2.91,
        "threshold": 5.0,
    }
    result = row_result(ExperimentRow.from_json(row))
    assert result.grad_norm == math.inf and math.isnan(result.rel_diff or 0.0)


def test_a_mitigation_that_clears_a_nan_step_is_written_up(tmp_path: Path, spike_run: SpikeRun) -> None:
    """A NaN baseline is the clearest spike there is: its null in the result file does not read as no spike."""
    open_task(tmp_path, JOB, spike_run.snapshot)
    baseline = replay_result(spike_run.snapshot, math.nan, "reproduced", recorded_grad_norm=math.nan)
    record_replay(tmp_path, JOB, baseline, new_run_dir(tmp_path, JOB).write_result(baseline))
    fix = {"log_ratio_clip": 5.0}
    cleared = replay_result(
        spike_run.snapshot, 2.09, "cleared", mitigations=fix, recorded_grad_norm=math.nan, baseline_grad_norm=math.nan
    )
    cleared.verdict_basis = verdict_basis(2.09, math.nan, MEDIAN, THRESHOLD, "detector", THRESHOLD)
    path = new_run_dir(tmp_path, JOB).write_result(cleared)
    assert path is not None and strict_json(path.read_text())["baseline_grad_norm"] is None  # NaN, as kept
    assert record_replay(tmp_path, JOB, cleared, path) == "E2"

    method = add_method(tmp_path, JOB, "E2", "log-ratio-clip-nan", "Clips the log-ratio of the one -inf token.")

    assert Path(method.path).is_file()
