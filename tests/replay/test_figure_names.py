"""Every log-ratio figure says what it compares (`<figure>_<a>_vs_<b>`, as diagnose's evidence does): the replayed
policy against its ratio's base in attribution and replay, the stored old against the stored rollout log-probs in
the batch analysis. An attribution.json written under the old name (`max_abs_log_ratio`) still reads everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.analysis.batch_signals import analyze_snapshot
from axrl_spike_replay.cli.replay_commands import render_attribution
from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.experiment.result import Attribution
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.workspace.method_files.signals import summarise_attribution

OLD = "max_abs_log_ratio"
NEW = "max_abs_log_ratio_current_vs_base"


@pytest.fixture(scope="module")
def written(spike_snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """attribution.json as `attribute` writes it now."""
    workspace = tmp_path_factory.mktemp("figure-names")
    a = run_request(replay_request(What(spike_snapshot, verb="attribute", top=3), workspace=workspace))
    return json.loads((Path(a.output_dir) / "attribution.json").read_text())


@pytest.fixture
def old_shape(written: dict, tmp_path: Path) -> tuple[Path, dict]:
    """The same attribution as a file written before the rename: its samples carry `max_abs_log_ratio`."""
    doc = json.loads(json.dumps(written))
    for s in doc["samples"]:
        s[OLD] = s.pop(NEW)
    path = tmp_path / "attribution.json"
    path.write_text(json.dumps(doc))
    return path, doc


def test_an_attribution_written_now_names_both_sides_of_its_log_ratio(written: dict) -> None:
    assert written["log_ratio_base"] in ("old", "rollout")  # the base the figure is taken against, beside it
    for s in written["samples"]:
        assert OLD not in s
        assert s[NEW] > 1.0  # the ratio-outlier capture: far-off rollout log-probs on its carrying samples


def test_an_old_attribution_file_still_reads_in_diagnose_the_report_and_the_cli(
    spike_snapshot: Path, written: dict, old_shape: tuple[Path, dict], cli, tmp_path: Path
) -> None:
    path, doc = old_shape
    values = [s[NEW] for s in written["samples"]]

    diagnosis = diagnose_snapshot(spike_snapshot, attribution=path, model="never")
    assert [row[NEW] for row in diagnosis.attribution_top] == values[: len(diagnosis.attribution_top)]
    assert {row["log_ratio_base"] for row in diagnosis.attribution_top} == {written["log_ratio_base"]}
    assert "max_abs_log_ratio_vs_base" not in diagnosis.attribution_top[0]  # diagnose's own old name is gone too
    run = cli("diagnose", spike_snapshot, "--attribution", path, "--model", "never", "--workspace", tmp_path, "--json")
    assert run.code == 0 and [row[NEW] for row in run.json()["attribution_top"]] == [
        row[NEW] for row in diagnosis.attribution_top
    ]

    base = written["log_ratio_base"]
    report_line = summarise_attribution(doc, 1)[0]
    assert f"max |log(pi/pi_{base})| {values[0]:.4g}" in report_line
    assert summarise_attribution(doc, 3) == summarise_attribution(written, 3)  # old and new shape read alike
    assert render_attribution(Attribution.from_json(doc)) == render_attribution(Attribution.from_json(written))


def test_the_batch_analysis_names_its_figures_old_vs_rollout(spike_snapshot: Path) -> None:
    a = analyze_snapshot(spike_snapshot, top=2)
    row = a.samples["rows"][0]
    assert {"max_abs_log_ratio_old_vs_rollout", "seq_log_ratio_old_vs_rollout"} <= set(row)
    assert not {"max_abs_log_ratio", "seq_log_ratio"} & set(row)  # never the attribution's figure's old name
    token = a.outliers["tokens_by_abs_log_ratio_old_vs_rollout"][0]
    assert token["log_ratio_old_vs_rollout"] == pytest.approx(token["old_logprob"] - token["rollout_logprob"])
    assert set(a.outliers) == {
        "tokens_by_abs_log_ratio_old_vs_rollout",
        "tokens_by_abs_advantage",
        "samples_by_abs_log_ratio_old_vs_rollout",
        "samples_by_abs_advantage",
    }
    assert a.ratio_old_vs_rollout["abs_log_ratio"]["max"] == pytest.approx(
        max(r["max_abs_log_ratio_old_vs_rollout"] for r in a.samples["rows"])
    )
    assert a.ratio is a.ratio_old_vs_rollout  # read under its old name by code written before


def test_a_replays_rank_metrics_name_the_base_their_log_ratio_is_taken_against(tiny_snapshot: Path) -> None:
    rollout = run_replay(
        replay_request(What(tiny_snapshot), how=How(nproc=1))
    )  # the tiny snapshot's ratio is against rollout
    old = run_replay(replay_request(What(tiny_snapshot, mitigations={"is_base_logprobs": "old"}), how=How(nproc=1)))
    for result, base, other in ((rollout, "rollout", "old"), (old, "old", "rollout")):
        for metrics in result.rank_metrics:
            assert metrics[f"max_abs_log_ratio_current_vs_{base}"] >= 0.0
            assert f"max_abs_log_ratio_current_vs_{other}" not in metrics
            assert "max_abs_log_ratio" not in metrics and "kl" not in metrics
            assert metrics["kl_current_vs_ref"] >= 0.0
