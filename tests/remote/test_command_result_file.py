"""The trainer's replay command is someone else's code: what it writes in `replay_result.json` is checked field by
field (a malformed file fails the run by name and is recorded as failed, not cancelled), a `tolerance` it gives
is never used, and a command that leaves a `setsid` child behind still finishes cleanly from the CLI."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from remote_helpers import RECORDED, kill_marked, wait_until_gone, workspace_with

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.elsewhere import replay_elsewhere
from axrl_spike_replay.investigation.request import What, Where, replay_request
from axrl_spike_replay.vocabulary import Verdict

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "mcp_server"
WRITES = """\
import argparse, pathlib, sys
p = argparse.ArgumentParser()
p.add_argument("--snapshot"); p.add_argument("--out")
a = p.parse_args()
print("grad_norm=STDOUT_NORM", flush=True)
pathlib.Path(a.out, "replay_result.json").write_bytes(DOC)
"""


def command_writing(checkout: Path, doc: bytes, stdout_norm: float = RECORDED) -> None:
    """The node's replay command: prints a grad norm, then writes `doc` as its result file."""
    script = WRITES.replace("DOC", repr(doc)).replace("STDOUT_NORM", repr(stdout_norm))
    (checkout / "tools" / "reproduce_spike.py").write_text(script)


def only_run(ws: Path) -> Path:
    (run,) = (ws / "tmp" / "spike-replay" / "cmd-job").iterdir()
    return run


MALFORMED = {
    "nested": (b'{"grad_norm": {"value": 56.75}}', "grad_norm must be a number, got object"),
    "list-shaped": (b"[56.75, 1.0]", "must be a JSON object, got a JSON array"),
    "string norm": (b'{"grad_norm": "fifty-six"}', "grad_norm must be a number, got string 'fifty-six'"),
    "bool norm": (b'{"grad_norm": true}', "grad_norm must be a number, got boolean"),
    "negative norm": (b'{"grad_norm": -3.0}', "grad_norm must not be negative"),
    "string world size": (b'{"grad_norm": 56.75, "world_size_used": "two"}', "world_size_used must be an integer"),
    "huge world size": (b'{"grad_norm": 56.75, "world_size_used": 1e300}', "world_size_used must be an integer"),
    "device escape": (b'{"grad_norm": 56.75, "device": "\\u001b[2Jcuda"}', "device must be a device name"),
    "top params a string": (b'{"grad_norm": 56.75, "top_params": "w1"}', "top_params must be a list"),
    "top param norm a list": (
        b'{"grad_norm": 56.75, "top_params": [{"name": "w", "grad_norm": [1]}]}',
        "top_params[0]: grad_norm must be a number",
    ),
    "deep nesting": (b'{"grad_norm": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper than 8 levels"),
    "huge integer": (b'{"grad_norm": 1' + b"0" * 5000 + b"}", "holds an integer of 5001 digits"),
    "not JSON": (b'{"grad_norm": 56.75', "is not valid JSON"),
    "not UTF-8": (b'{"grad_norm": 56.75, "device": "\xff"}', "is not UTF-8 text"),
    "too large": (b'{"grad_norm": 56.75, "pad": "' + b"x" * (5 << 20) + b'"}', "more than the 4194304-byte limit"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_result_file_fails_the_run_by_name_and_is_recorded_as_failed(
    case: str, training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    doc, says = MALFORMED[case]
    command_writing(training_checkout, doc)
    ws = workspace_with(tmp_path, training_checkout, None)
    with pytest.raises(AxrlError) as info:
        replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command"), workspace=ws))
    message = str(info.value)
    assert says in message and "replay_result.json" in message, message
    assert len(message) < 2000 and "\x1b" not in message and "Traceback" not in message
    recorded = json.loads((only_run(ws) / "replay_result.json").read_text())
    assert recorded["verdict"] == "failed" and says in recorded["error"]
    assert "cancelled" not in recorded["error"]
    task = ws / "agent-task" / "spike-replay" / "cmd-job.md"
    assert not task.exists() or "cancelled" not in task.read_text()


def test_a_tolerance_the_command_gives_itself_is_never_used(
    training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    """rel_diff 0.998 is not a reproduction, whatever the command says its tolerance is."""
    far = RECORDED * 0.002
    command_writing(training_checkout, json.dumps({"grad_norm": far, "tolerance": 1e9, "device": "cpu"}).encode())
    ws = workspace_with(tmp_path, training_checkout, None)
    result = replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command"), workspace=ws))
    assert result.verdict is Verdict.NOT_REPRODUCED and result.rel_diff == pytest.approx(0.998)
    assert result.tolerance is not None and result.tolerance < 0.01
    assert "tolerance: not used" in (only_run(ws) / "replay.log").read_text()


def test_spelled_out_nan_and_a_valid_top_k_are_read(training_checkout: Path, snapshot: Path, tmp_path: Path) -> None:
    doc = {
        "grad_norm": RECORDED,
        "world_size_used": 2,
        "device": "cuda:0",
        "top_params": [{"name": "w", "grad_norm": "inf"}],
    }
    command_writing(training_checkout, json.dumps(doc).encode())
    ws = workspace_with(tmp_path, training_checkout, None)
    result = replay_elsewhere(replay_request(What(snapshot), where=Where(backend="command"), workspace=ws))
    assert result.verdict is Verdict.REPRODUCED and result.device == "cuda:0"
    assert [p.to_json() for p in result.top_params] == [{"name": "w", "grad_norm": float("inf")}]


def test_a_command_leaving_a_setsid_child_finishes_cleanly_from_the_cli(
    training_checkout: Path, snapshot: Path, tmp_path: Path
) -> None:
    """The child is stopped when the command ends; the run is not "timed out"; no asyncio noise on stderr."""
    marker = f"axrl-cli-stray-{secrets.token_hex(6)}"
    script = training_checkout / "tools" / "reproduce_spike.py"
    stray = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}],\n"
        "                 start_new_session=True)\n"
    )
    script.write_text(stray + script.read_text())
    ws = workspace_with(tmp_path, training_checkout, None)
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)}
    argv = [sys.executable, "-m", "axrl_spike_replay", "replay", str(snapshot), "--backend", "command"]
    try:
        done = subprocess.run(
            [*argv, "--workspace", str(ws), "--timeout", "120", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["verdict"] == "reproduced"
        assert "Event loop is closed" not in done.stderr and "Traceback" not in done.stderr
        assert wait_until_gone(marker) == []
    finally:
        kill_marked(marker)
