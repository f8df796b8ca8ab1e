"""Where an investigation's files live inside a workspace, and which names are allowed there."""

from __future__ import annotations

import re
from pathlib import Path

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError, ConfigError

TASKS_DIR = Path("agent-task") / "spike-replay"
METHODS_DIR = Path("spike-mitigation-methods")
TMP_DIR = Path("tmp") / "spike-replay"
METHODS_INDEX = "README.md"

_PLAIN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~+-]*")
MAX_NAME = 200


def check_plain_name(name: str, what: str) -> str:
    """`name` if it is a plain, visible file name (no separators, not `.`/`..`); else ConfigError."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{what} is empty; give a plain file name such as 'tis-clip-2'")
    if "/" in name or "\\" in name or "\x00" in name:
        raise ConfigError(f"{what} {shown(name)} is not a plain file name: it contains a path separator")
    if name.startswith("."):
        raise ConfigError(f"{what} {shown(name)} is not a plain file name: it is hidden or a relative path")
    # fullmatch: `$` would let a trailing newline through
    if len(name) > MAX_NAME or not _PLAIN_NAME_RE.fullmatch(name):
        raise ConfigError(
            f"{what} {shown(name)} is not a plain file name: use letters, digits and . _ ~ + - "
            f"(at most {MAX_NAME} characters)"
        )
    return name


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
