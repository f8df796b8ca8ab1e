"""A replay result whose verdict or fidelity is outside the tool's vocabulary cannot be written up as a method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from record_helpers import JOB, replay_result, save_result

from axrl_spike_replay.cli import main
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.task_record.task_log import record_replay

SNAP = Path("/snapshots/run~fixture-moe__actor/checkpoints/spike_snapshots/iter_0000005")


def test_a_hand_edited_verdict_is_named_with_its_file(tmp_path: Path, capsys) -> None:
    open_task(tmp_path, JOB, snapshot=SNAP)
    base = replay_result(SNAP, 37.4, "reproduced")
    record_replay(tmp_path, JOB, base, save_result(tmp_path, "base", base))
    tis = replay_result(SNAP, 3.8, "cleared", mitigations={"mismatch_token_clip_max": 2}, baseline_grad_norm=37.4)
    path = save_result(tmp_path, "tis", tis)
    record_replay(tmp_path, JOB, tis, path)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "verdict": "definitely-cleared\x1b[31m"}))

    with pytest.raises(AxrlError, match=r"tis/replay_result.json of attempt E2 is unreadable: result verdict must be"):
        add_method(tmp_path, JOB, "E2", "tis-clip", "clip the mismatched tokens")
    argv = ["method", "add", "--job", JOB, "--attempt", "E2", "--name", "tis-clip", "--rationale", "r"]
    argv += ["--workspace", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "got 'definitely-cleared\\x1b[31m'" in err and "\x1b" not in err
    assert not (tmp_path / "spike-mitigation-methods" / "tis-clip.md").exists()

    path.write_text(json.dumps(doc))  # the file as the replay wrote it: written up as before
    written = add_method(tmp_path, JOB, "E2", "tis-clip", "clip the mismatched tokens")
    assert written.verdict == "cleared" and written.fidelity == "full" and written.status == "proven"
