"""Where an investigation's files live inside a workspace (names checked by `names.check_plain_name`)."""

from __future__ import annotations

import shlex
from pathlib import Path

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.names import check_plain_name

TASKS_DIR = Path("agent-task") / "spike-replay"
METHODS_DIR = Path("spike-mitigation-methods")
TMP_DIR = Path("tmp") / "spike-replay"
METHODS_INDEX = "README.md"
RECORDING_VERBS = ("replay", "sweep", "attribute")  # the verbs whose runs land in a workspace and its task


def check_workspace(workspace: str | Path) -> Path:
    """The workspace as an absolute path; AxrlError when it does not exist or is not a directory."""
    root = Path(workspace).expanduser()
    if not root.exists():
        raise AxrlError(f"workspace {str(root)!r} does not exist; create it or pass another `workspace`")
    if not root.is_dir():
        raise AxrlError(f"workspace {str(root)!r} is not a directory")
    return root.resolve()


def task_json_path(workspace: Path, job: str) -> Path:
    """`<workspace>/agent-task/spike-replay/<job>.json`: the task's structured state."""
    return workspace / TASKS_DIR / f"{check_plain_name(job, 'job name')}.json"


def task_md_path(workspace: Path, job: str) -> Path:
    """`<workspace>/agent-task/spike-replay/<job>.md`: the task file people read."""
    return workspace / TASKS_DIR / f"{check_plain_name(job, 'job name')}.md"


def methods_dir(workspace: Path) -> Path:
    """`<workspace>/spike-mitigation-methods/`."""
    return workspace / METHODS_DIR


def job_tmp_dir(workspace: Path, job: str) -> Path:
    """`<workspace>/tmp/spike-replay/<job>/`: command outputs and the report."""
    return workspace / TMP_DIR / check_plain_name(job, "job name")


def in_workspace(
    command: str | None, workspace: Path, job: str | None = None, snapshot_job: str | None = None
) -> str | None:
    """`command` as people rerun it from any directory: an `axrl-spike-replay replay|sweep|attribute ...` line
    without `--workspace` gets `--workspace <workspace>` (the default, the current directory, would record the run
    wherever it is started), and `--job <job>` when the task's job is not the snapshot's own; anything else (a
    trainer's command, a line that does not split) is returned as it is."""
    if not command:
        return command
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    if len(words) < 2 or Path(words[0]).name != "axrl-spike-replay" or words[1] not in RECORDING_VERBS:
        return command
    given = {word.split("=", 1)[0] for word in words if word.startswith("--")}
    extra = [] if "--workspace" in given else ["--workspace", str(workspace)]
    if job and snapshot_job and job != snapshot_job and "--job" not in given:
        extra += ["--job", job]
    return f"{command} {shlex.join(extra)}" if extra else command
