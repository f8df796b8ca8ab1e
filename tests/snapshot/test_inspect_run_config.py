"""`inspect` reads the run config as the replay will: a YAML syntax error, an alias or a document that is not a
mapping of sections is a problem naming the file, not "no problems"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from axrl_spike_replay.snapshot.inspect import inspect_snapshot

BROKEN = {
    "a syntax error": ("model: {kind: tiny_moe\nloss: [1, 2\n", "not valid YAML"),
    "an alias": (
        "base: &b {kind: tiny_moe}\nmodel: *b\nloss: {}\nrouting: {}\nparallel: {}\n",
        "uses a YAML alias (*'b')",
    ),
    "a list": ("- model\n- loss\n", "expected a mapping of sections, got list"),
    "not UTF-8": (b"model: \xff\xfe\n", "not UTF-8 text"),
}


@pytest.mark.parametrize("broken", BROKEN, ids=list(BROKEN))
def test_a_run_config_the_replay_cannot_read_is_a_problem(golden_snapshot: Path, tmp_path: Path, cli, broken) -> None:
    snap = shutil.copytree(golden_snapshot, tmp_path / golden_snapshot.name)
    text, message = BROKEN[broken]
    path = snap / "run_config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())

    problems = inspect_snapshot(snap).problems
    [problem] = [p for p in problems if "run_config.yaml" in p]
    assert problem.startswith(f"run config {path}: ") and message in problem
    run = cli("inspect", snap, "--json")
    assert any(message in p for p in json.loads(run.out)["problems"]) and "Traceback" not in run.err


def test_the_golden_run_config_is_no_problem(golden_snapshot: Path) -> None:
    assert inspect_snapshot(golden_snapshot).problems == []
