"""`method add` quotes the figures the investigation already recorded (the replay results, the task's diagnosis,
an attribution.json of the snapshot) and computes nothing heavy: no batch analysis, no attribution replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from record_helpers import JOB, RECORDED, SpikeRun, replay_result, save_result

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.task_record.task_log import record_replay

BASE = 37.4189
CLEARED = 3.812
SRC = Path(__file__).resolve().parents[2] / "mcp_server"


def _investigate(workspace: Path, snapshot: Path, *, diagnose: bool = True) -> str:
    """A task with a baseline replay (its consistency as a replay records it) and a cleared attempt; its id."""
    open_task(workspace, JOB, str(snapshot), diagnosis="never" if diagnose else "off")
    consistency = {
        "checked": ["spike_ratio_vs_norms", "ranks_vs_files", "rank_loss_vs_replay"],
        "problems": [{"name": "rank_loss_vs_replay", "message": "rank 1 recorded loss 0.1, the replay computes 0.3"}],
        "self_consistent": False,
        "agrees_with_log": None,
    }
    base = replay_result(
        snapshot, BASE, "reproduced", consistency=consistency, top_params=[{"name": "head.weight", "grad_norm": 30.5}]
    )
    record_replay(workspace, JOB, base, save_result(workspace, "base", base))
    mitigated = replay_result(
        snapshot,
        CLEARED,
        "cleared",
        mitigations={"mismatch_token_clip_max": 2.0},
        baseline_grad_norm=BASE,
        change_vs_baseline=CLEARED / BASE - 1,
        clean_gradient={"left_out": ["0:1"], "share_left_out": 0.93},
    )
    exp_id = record_replay(workspace, JOB, mitigated, save_result(workspace, "tis", mitigated))
    assert exp_id is not None
    return exp_id


def _signals(path: str | Path) -> str:
    return Path(path).read_text().split("## Key signals")[1].split("## Change")[0]


def test_method_add_quotes_the_recorded_figures_and_loads_no_model(tmp_path: Path, spike_run: SpikeRun) -> None:
    attempt = _investigate(tmp_path, spike_run.snapshot)
    # in a fresh process: neither the batch analysis nor the attribution replay can run without torch
    code = textwrap.dedent(
        f"""
        import json, sys
        from axrl_spike_replay.workspace.method_files.methods import add_method
        added = add_method({str(tmp_path)!r}, {JOB!r}, {attempt!r}, "tis-2", "caps the importance weight at 2")
        print(json.dumps({{"torch": "torch" in sys.modules, "path": added.path, "signals": added.signals}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    doc = json.loads(out)
    assert doc["torch"] is False
    signals = _signals(doc["path"])
    assert f"- spike: recorded grad norm {RECORDED:.4g}, 12.86x the median 2.91 (iteration 5, world size 2)" in signals
    # the baseline replay's consistency, named problems included
    assert "baseline replay E1: grad norm 37.42, rel diff vs recorded" in signals
    assert "snapshot 1 self-inconsistencies" in signals
    assert "consistency problem [rank_loss_vs_replay]: rank 1 recorded loss 0.1" in signals
    assert "largest parameter grad norms at the baseline: head.weight 30.5" in signals
    # the samples the mitigated replay's clean gradient left out, and what was not measured
    assert "0:1 carry 93.0%" in signals
    assert "per-sample attribution: only the samples carrying the norm were recorded" in signals
    assert doc["signals"]["lines"][0].startswith("spike: recorded grad norm")


def test_without_a_diagnosis_or_attribution_the_method_file_says_what_was_not_measured(
    tmp_path: Path, spike_run: SpikeRun
) -> None:
    attempt = _investigate(tmp_path, spike_run.snapshot, diagnose=False)
    result_path = tmp_path / "tmp" / "spike-replay" / JOB / "tis" / "replay_result.json"
    doc = json.loads(result_path.read_text())
    doc["clean_gradient"] = None
    result_path.write_text(json.dumps(doc))
    signals = _signals(add_method(tmp_path, JOB, attempt, "tis-2", "caps the importance weight").path)
    assert "batch signals: not measured (the task holds no diagnosis of this snapshot)" in signals
    assert "per-sample attribution: not measured (no attribution.json of this snapshot" in signals
    assert "diagnosis:" not in signals and "samples carrying" not in signals


@pytest.mark.slow
def test_an_attribution_of_the_snapshot_in_the_jobs_runs_is_quoted(tmp_path: Path, spike_run: SpikeRun) -> None:
    from axrl_spike_replay.investigation.request import What, replay_request
    from axrl_spike_replay.investigation.runs import run_request

    attempt = _investigate(tmp_path, spike_run.snapshot)
    attribution = run_request(
        replay_request(What(spike_run.snapshot, verb="attribute", top=2), workspace=tmp_path, job=JOB)
    )  # a real attribution, written into the job's runs as `attribute --job` writes it
    written = Path(attribution.output_dir) / "attribution.json"
    assert written.is_file()
    other = json.loads(written.read_text())  # one under a mitigation describes another gradient: never quoted
    other["mitigations"], other["samples"][0]["share"] = {"advantage_clip": 1.0}, 0.111
    (tmp_path / "tmp" / "spike-replay" / JOB / "99999999-999999").mkdir()
    (tmp_path / "tmp" / "spike-replay" / JOB / "99999999-999999" / "attribution.json").write_text(json.dumps(other))

    signals = _signals(add_method(tmp_path, JOB, attempt, "tis-2", "caps the importance weight").path)
    top = attribution.samples[0]
    assert f"samples carrying the grad norm (of 4): rank {top.rank} sample {top.sample}: {top.share * 100:.1f}%" in (
        signals
    )
    assert f"(from {written})" in signals and "11.1%" not in signals
    assert "per-sample attribution" not in signals


def test_a_result_file_edited_to_say_cleared_is_still_refused(tmp_path: Path, spike_run: SpikeRun) -> None:
    attempt = _investigate(tmp_path, spike_run.snapshot)
    result_path = tmp_path / "tmp" / "spike-replay" / JOB / "tis" / "replay_result.json"
    doc = json.loads(result_path.read_text())
    doc["grad_norm"] = BASE  # the figures say no change, whatever the stored verdict
    result_path.write_text(json.dumps(doc))
    with pytest.raises(AxrlError, match="not measurably below the baseline"):
        add_method(tmp_path, JOB, attempt, "tis-2", "caps the importance weight")
    assert not (tmp_path / "spike-mitigation-methods" / "tis-2.md").exists()
