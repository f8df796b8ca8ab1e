"""A second sweep of the same snapshot, replayed the same way, reuses the baseline the task holds instead of logging
it again; a baseline replayed another way (another layout) is a new row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from axrl_spike_replay.investigation.task_opening import open_task

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
JOB = "fixture-moe"


@pytest.mark.slow
def test_two_sweeps_share_one_logged_baseline(tmp_path: Path, cli) -> None:
    out = tmp_path / "outputs" / FIXTURE.name
    shutil.copytree(FIXTURE, out)
    spike = out / "checkpoints" / "spike_snapshots" / "iter_0000021"
    ws = tmp_path / "ws"
    ws.mkdir()
    view = open_task(ws, JOB, spike, diagnosis="off")
    for items in (["mismatch_token_clip_max=2"], ["dual_clip_c=3", "log_ratio_clip=5"]):
        args = [a for item in items for a in ("--mitigation", item)]
        run = cli("sweep", spike, *args, "--workspace", ws, "--job", JOB, "--json")
        assert run.code == 0, run.err
    rows = json.loads(Path(view.state_file).read_text())["experiments"]
    assert [r["is_baseline"] for r in rows] == [True, False, False, False]
    assert {r["baseline_grad_norm"] for r in rows[1:]} == {rows[0]["grad_norm"]}
    run = cli("replay", spike, "--nproc", "1", "--workspace", ws, "--job", JOB, "--json")
    assert run.code == 0, run.err
    rows = json.loads(Path(view.state_file).read_text())["experiments"]
    assert rows[-1]["is_baseline"] and rows[-1]["fidelity"] == "full"  # another layout: logged
