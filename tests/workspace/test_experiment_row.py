"""The task's experiment rows are typed (`ExperimentRow`) and keep the task file's JSON key for key: a row as the
task state holds it today reads and writes back byte for byte, keys an earlier or later version wrote are kept where
they were, figures spelled "inf" / "nan" stay spelled, and a replay logged now writes the keys it always wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from record_helpers import JOB, SpikeRun, replay_result, save_result

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.paths import task_json_path
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.task import TaskState
from axrl_spike_replay.workspace.task_record.task_log import record_replay
from axrl_spike_replay.workspace.task_record.task_state import read_state

# The keys of a logged replay's row, in the order the task state has held them (a mitigated row judged against a
# logged baseline ends with `baseline`).
TODAY_KEYS = [
    "id", "time", "snapshot", "backend", "target", "fidelity", "mitigations", "patch_sha256", "change", "is_baseline",
    "hypothesis", "finding", "rank_losses_match", "config_id", "grad_norm", "recorded_grad_norm", "rel_diff",
    "median_norm", "ratio_to_median", "threshold", "baseline_grad_norm", "change_vs_baseline", "verdict",
    "world_size_saved", "world_size_used", "device", "job_name", "role", "iteration", "node", "result_path", "command",
]  # fmt: skip

MITIGATED = {
    "id": "E2",
    "time": "2026-01-01T00:00:05+00:00",
    "snapshot": "/runs/run1~job__actor/checkpoints/spike_snapshots-active/iter_0000005",
    "backend": "torch",
    "target": "gpu-node",
    "fidelity": "full",
    "mitigations": {"advantage_clip": 1.0},
    "patch_sha256": None,
    "change": "advantage_clip=1.0",
    "is_baseline": False,
    "hypothesis": {},
    "finding": None,
    "rank_losses_match": None,
    "config_id": "advantage_clip=1.0",
    "grad_norm": 3.25,
    "recorded_grad_norm": 37.42,
    "rel_diff": 0.913,
    "median_norm": 2.91,
    "ratio_to_median": 1.117,
    "threshold": 5.0,
    "baseline_grad_norm": 37,
    "change_vs_baseline": -0.912,
    "verdict": "cleared",
    "world_size_saved": 2,
    "world_size_used": 2,
    "device": "cuda",
    "job_name": "job",
    "role": "actor",
    "iteration": 5,
    "node": {"gpus": [{"name": "H100", "memory_mib": 81559}]},
    "result_path": "/ws/tmp/spike-replay/job/20260101-000005/replay_result.json",
    "command": "axrl-spike-replay replay /runs/... --mitigation advantage_clip=1.0",
    "baseline": "E1",
}


def _dumped(doc: object) -> str:
    return json.dumps(doc, indent=2, default=str)  # as the task state is written


def test_todays_row_reads_typed_and_writes_back_byte_for_byte() -> None:
    row = ExperimentRow.from_json(json.loads(json.dumps(MITIGATED)))
    assert row.id == "E2" and row.mitigations == {"advantage_clip": 1.0} and row.baseline == "E1"
    assert row.grad_norm == 3.25 and row.world_size_used == 2 and row.is_baseline is False
    assert row.node == {"gpus": [{"name": "H100", "memory_mib": 81559}]}
    assert _dumped(row.to_json()) == _dumped(MITIGATED)
    assert isinstance(row.to_json()["baseline_grad_norm"], int)  # 37 stays 37, not 37.0


def test_unknown_keys_stay_where_they_were_and_a_field_set_later_comes_after_them() -> None:
    doc = dict(MITIGATED)
    del doc["baseline"], doc["node"]  # a row written before either existed
    items = list(doc.items())
    doc = dict([*items[:5], ("written_by_a_later_version", {"x": [1, 2]}), *items[5:], ("note", "kept")])
    row = ExperimentRow.from_json(doc)
    assert row.unknown == {"written_by_a_later_version": {"x": [1, 2]}, "note": "kept"}
    assert _dumped(row.to_json()) == _dumped(doc)
    row.baseline = "E1"
    assert list(row.to_json()) == [*doc, "baseline"]
    assert row.to_json()["written_by_a_later_version"] == {"x": [1, 2]}


def test_figures_spelled_by_an_earlier_version_read_as_numbers_and_stay_spelled() -> None:
    doc = {**MITIGATED, "grad_norm": "inf", "rel_diff": "nan", "change_vs_baseline": "-inf", "mitigations": None}
    row = ExperimentRow.from_json(doc)
    assert row.grad_norm == math.inf and math.isnan(row.rel_diff or 0.0) and row.change_vs_baseline == -math.inf
    assert row.mitigations == {}
    assert _dumped(row.to_json()) == _dumped(doc)
    row.grad_norm = 4.0  # a figure changed since is written as it is now
    assert row.to_json()["grad_norm"] == 4.0 and row.to_json()["rel_diff"] == "nan"


def test_a_minimal_row_of_an_early_task_reads_and_writes_only_its_keys() -> None:
    doc = {"id": "E1", "snapshot": "/s", "backend": "torch", "target": "local", "fidelity": "full", "verdict": "worse"}
    row = ExperimentRow.from_json(doc)
    assert row.is_baseline is False and row.hypothesis == {} and row.command is None
    assert row.to_json() == doc and list(row.to_json()) == list(doc)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"id": 3}, "`id` is missing or not text"),
        ({"grad_norm": "big"}, "`grad_norm` must be a number, got 'big'"),
        ({"grad_norm": True}, "`grad_norm` must be a number"),
        ({"world_size_used": 2.5}, "`world_size_used` must be a whole number, got float"),
        ({"is_baseline": "yes"}, "`is_baseline` must be true or false, got str"),
        ({"mitigations": ["advantage_clip"]}, "`mitigations` must be a record, got list"),
        ({"verdict": 1}, "`verdict` must be text, got int"),
    ],
)
def test_a_row_of_the_wrong_kind_is_refused_naming_the_task_file_row_and_key(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    doc = {
        "format_version": 1,
        "job": "job",
        "created_at": "t",
        "updated_at": "t",
        "experiments": [{"id": "E1"}, {**MITIGATED, **change}],
    }
    with pytest.raises(AxrlError, match=r"task state /ws/job\.json: experiments\[1\]: " + _re(message)):
        TaskState.from_json(doc, "/ws/job.json", "job", "t")


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_a_task_state_of_todays_rows_round_trips_byte_for_byte() -> None:
    baseline = {
        **{k: v for k, v in MITIGATED.items() if k != "baseline"},
        "id": "E1",
        "mitigations": {},
        "change": "baseline",
        "is_baseline": True,
        "config_id": "baseline",
        "verdict": "reproduced",
        "grad_norm": 37.0,
        "baseline_grad_norm": None,
        "change_vs_baseline": None,
    }
    doc = {
        "format_version": 1,
        "job": "job",
        "created_at": "t0",
        "updated_at": "t1",
        "snapshot": MITIGATED["snapshot"],
        "snapshot_history": [],
        "command": "axrl-spike-replay replay /runs/...",
        "experiments": [baseline, {**MITIGATED, "grad_norm": "inf"}],
        "failed": [],
        "observations": [{"time": "t", "text": "a note"}],
        "next_steps": [],
        "methods": [],
        "reports": [],
        "preserved_copies": [],
        "diagnoses": [],
        "command_source": "replay",
        "from_a_later_version": True,
    }
    text = _dumped(doc)
    state = TaskState.from_json(json.loads(text), "job.json", "job", "t")
    assert [type(row) for row in state.experiments] == [ExperimentRow, ExperimentRow]
    assert _dumped(state.to_json()) == text


def test_a_replay_logged_now_writes_the_keys_the_task_always_held(tmp_path: Path, spike_run: SpikeRun) -> None:
    open_task(tmp_path, JOB, spike_run.snapshot)
    base = replay_result(spike_run.snapshot, 37.0, "reproduced")
    assert record_replay(tmp_path, JOB, base, save_result(tmp_path, "base", base)) == "E1"
    mitigated = replay_result(
        spike_run.snapshot,
        3.0,
        "cleared",
        mitigations={"advantage_clip": 1.0},
        config_id="advantage_clip=1.0",
        baseline_grad_norm=37.0,
        change_vs_baseline=3.0 / 37.0 - 1,
    )
    assert record_replay(tmp_path, JOB, mitigated, save_result(tmp_path, "clip", mitigated)) == "E2"

    on_disk = json.loads(task_json_path(tmp_path, JOB).read_text())
    first, second = on_disk["experiments"]
    assert list(first) == TODAY_KEYS
    assert list(second) == [*TODAY_KEYS, "baseline"] and second["baseline"] == "E1"
    assert second["mitigations"] == {"advantage_clip": 1.0} and second["is_baseline"] is False
    rows = read_state(tmp_path, JOB).experiments
    assert [(r.id, r.verdict, r.is_baseline, r.baseline) for r in rows] == [
        ("E1", "reproduced", True, None),
        ("E2", "cleared", False, "E1"),
    ]
    assert [r.to_json() for r in rows] == on_disk["experiments"]
