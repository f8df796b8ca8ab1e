"""The trainer's own replay command reports a fidelity the tool does not know: the run fails and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from remote_helpers import workspace_with

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.elsewhere import replay_elsewhere
from axrl_spike_replay.investigation.request import What, Where, replay_request
from axrl_spike_replay.vocabulary import Fidelity, Verdict

SCRIPT = """\
import argparse, json, pathlib
p = argparse.ArgumentParser()
p.add_argument("--snapshot"); p.add_argument("--out")
a = p.parse_args()
meta = json.loads(pathlib.Path(a.snapshot, "axrl_metadata.json").read_text())
doc = {"grad_norm": meta["grad_norm"], "device": "cpu", "fidelity": FIDELITY}
pathlib.Path(a.out, "replay_result.json").write_text(json.dumps(doc))
"""


def test_an_unknown_fidelity_in_the_commands_result_fails_the_run_by_name(
    training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    script = training_checkout / "tools" / "reproduce_spike.py"
    ws = workspace_with(tmp_path, training_checkout, None)

    script.write_text(SCRIPT.replace("FIDELITY", json.dumps("half\x1b[2J")))
    with pytest.raises(AxrlError, match=r"replay failed: fidelity in the command's result must be one of full, "):
        replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command"), workspace=ws))
    (run,) = (ws / "tmp" / "spike-replay" / "cmd-job").iterdir()
    failed = json.loads((run / "replay_result.json").read_text())
    assert failed["verdict"] == "failed" and failed["grad_norm"] is None
    assert failed["error"] == "fidelity in the command's result must be one of full, reduced, got 'half\\x1b[2J'"

    script.write_text(SCRIPT.replace("FIDELITY", json.dumps("reduced")))
    result = replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command"), workspace=ws))
    assert result.verdict is Verdict.REPRODUCED and result.fidelity is Fidelity.REDUCED
