"""Files the tool writes get the mode a plain `open` would give them: teammates on shared storage read them.

Under umask 022 the task files, a replay's outputs and a snapshot's metadata come out 0644; under
umask 077 they stay private (0600). Each step runs as its own process with the umask set.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import axrl_spike_replay

PACKAGE_ROOT = Path(axrl_spike_replay.__file__).resolve().parents[1]
REPLAY_TESTS = Path(__file__).resolve().parents[1] / "replay"
JOB = "tiny-job"


def _run(argv: list[str], umask: int) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), str(REPLAY_TESTS)])}
    done = subprocess.run(argv, env=env, umask=umask, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _cli(umask: int, *args: str) -> str:
    return _run([sys.executable, "-m", "axrl_spike_replay", *args], umask)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o077, 0o600)], ids=["umask-022", "umask-077"])
def test_task_files_replay_outputs_and_snapshot_metadata_get_the_plain_open_mode(
    tmp_path: Path, umask: int, expected: int
) -> None:
    record = "from pathlib import Path; import sys; from tiny_snapshot import record_tiny_snapshot; "
    record += "print(record_tiny_snapshot(Path(sys.argv[1])))"
    snapshot = Path(_run([sys.executable, "-c", record, str(tmp_path / "spike_snapshots")], umask).strip())
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    _cli(umask, "task", "open", JOB, "--snapshot", str(snapshot), "--workspace", str(workspace))
    _cli(umask, "replay", str(snapshot), "--nproc", "1", "--workspace", str(workspace), "--job", JOB)

    [run_dir] = (workspace / "tmp" / "spike-replay" / JOB).iterdir()
    written = {
        "task state": workspace / "agent-task" / "spike-replay" / f"{JOB}.json",
        "task file": workspace / "agent-task" / "spike-replay" / f"{JOB}.md",
        "replay_result.json": run_dir / "replay_result.json",
        "command.txt": run_dir / "command.txt",
        "replay.log": run_dir / "replay.log",
        "metadata.json": snapshot / "metadata.json",
        "axrl_metadata.json": snapshot / "axrl_metadata.json",
        "run_config.yaml": snapshot / "run_config.yaml",
    }
    assert {name: oct(_mode(path)) for name, path in written.items()} == {name: oct(expected) for name in written}
