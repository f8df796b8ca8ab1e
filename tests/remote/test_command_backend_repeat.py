"""The command backend carries the replay request's `repeat` and `top_params` as the engine does: the command runs
`repeat` times (each run's files kept, the second and later under `repeat-<k>/`), the result gives each run's grad
norm and their spread, and lists the `top_params` largest parameter norms the command reported, the largest first."""

from __future__ import annotations

import json
from pathlib import Path

from remote_helpers import RECORDED, workspace_with

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.elsewhere import replay_elsewhere
from axrl_spike_replay.investigation.request import What, Where, replay_request
from axrl_spike_replay.vocabulary import Backend, Verdict

COUNTING = """\
import argparse, json, pathlib
p = argparse.ArgumentParser()
p.add_argument("--snapshot"); p.add_argument("--out")
a = p.parse_args()
counter = pathlib.Path("runs.txt")
run = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(run))
norm = RECORDED * (1 + 1e-7 * run)
params = [{"name": f"layer{i}.w", "grad_norm": float(i)} for i in (3, 9, 1, 7, 5)]
doc = {"grad_norm": norm, "device": "cpu", "top_params": params}
pathlib.Path(a.out, "replay_result.json").write_text(json.dumps(doc))
"""


def test_repeat_runs_the_command_each_time_and_top_params_cuts_its_list(
    training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    (training_checkout / "tools" / "reproduce_spike.py").write_text(COUNTING.replace("RECORDED", repr(RECORDED)))
    ws = workspace_with(tmp_path, training_checkout, None)
    what = What(snapshot, repeat=3, top_params=2)
    result = replay_elsewhere(replay_request(what, where=Where(backend=Backend.COMMAND), workspace=ws))
    assert isinstance(result, ReplayResult)
    assert (training_checkout / "runs.txt").read_text() == "3"
    assert result.repeat_grad_norms == [RECORDED * (1 + 1e-7 * run) for run in (1, 2, 3)]
    assert result.grad_norm == result.repeat_grad_norms[0] and result.verdict == Verdict.REPRODUCED
    assert result.repeat_spread == max(result.repeat_grad_norms) - min(result.repeat_grad_norms)
    assert [p.name for p in result.top_params] == ["layer9.w", "layer7.w"]
    (run_dir,) = (ws / "tmp" / "spike-replay" / "cmd-job").iterdir()
    for sub in ("", "repeat-2", "repeat-3"):
        assert (run_dir / sub / "command.txt").is_file() and (run_dir / sub / "stdout.log").is_file(), sub
    written = json.loads((run_dir / "replay_result.json").read_text())
    assert written["repeat_grad_norms"] == result.repeat_grad_norms and len(written["top_params"]) == 2


def test_one_run_by_default_and_the_default_list_of_ten(
    training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    (training_checkout / "tools" / "reproduce_spike.py").write_text(COUNTING.replace("RECORDED", repr(RECORDED)))
    ws = workspace_with(tmp_path, training_checkout, None)
    result = replay_elsewhere(replay_request(What(snapshot), where=Where(backend=Backend.COMMAND), workspace=ws))
    assert isinstance(result, ReplayResult)
    assert (training_checkout / "runs.txt").read_text() == "1"
    assert result.repeat_grad_norms == [] and result.repeat_spread is None
    assert [p.grad_norm for p in result.top_params] == [9.0, 7.0, 5.0, 3.0, 1.0]
