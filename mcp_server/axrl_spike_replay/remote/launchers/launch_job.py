"""What a launched job is, whichever engine starts it (torchrun over SSH, Slurm): the worker each process runs, the
request it reads, the result rank 0 writes, how it ended, and errors that name the node.

The worker-side half of the contract is the ground module `launch_worker` (the engine's own worker reads through it):
torchrun's environment gives each process its rank and world, argv[1] is the request file, and rank 0 writes the
result file atomically. The launcher reads that file only after every agent (or the Slurm job) ended successfully.
"""

from __future__ import annotations

import re
import secrets
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import clean_text, shown
from axrl_spike_replay.processes.launch_worker import REQUEST_FORMAT, REQUEST_VERSION
from axrl_spike_replay.remote.nodes.node_probe import NodeReport
from axrl_spike_replay.remote.transport.remote_errors import RemoteError
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, read_bounded
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json

if TYPE_CHECKING:
    from axrl_spike_replay.remote.transport.target_config import ResolvedTarget

FILE_MARK = "@@axrl-file"
LAUNCH_ID_ENV = "AXRL_LAUNCH_ID"  # every process of a job carries it, so a sweep can find leftovers by it
REQUEST_FILE = "request.json"
RESULT_FILE = "result.json"
MAX_RESULT_BYTES = 64 << 20
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_LAUNCH_ID_RE = re.compile(r"axrl-[0-9a-f]{12}")


class LaunchError(RemoteError):
    """A launched job failed to start, to rendezvous or to finish; `node` names the node at fault when known;
    `timed_out` when it ran past its timeout (then the job was stopped, and what its processes said as they were
    stopped is a consequence, not the cause)."""

    def __init__(self, message: str, node: str | None = None, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.node = node
        self.timed_out = timed_out


@dataclass(frozen=True)
class LaunchNode:
    """One node of a job: a name; how to reach it over SSH (None: this machine); the Python and setup lines the job
    runs with there (default: the target's, or this very interpreter here); and the address the other nodes reach
    it at (None: its host name as torchrun resolves it). A torchrun job's first node hosts the rendezvous."""

    name: str
    target: ResolvedTarget | None = None
    python: str = ""
    setup: tuple[str, ...] = ()
    address: str | None = None

    def __post_init__(self) -> None:
        if not self.python:
            object.__setattr__(self, "python", self.target.python if self.target is not None else sys.executable)
        if not self.setup and self.target is not None:
            object.__setattr__(self, "setup", tuple(self.target.setup))


@dataclass(frozen=True)
class WorkerEntry:
    """What each worker process runs: a module (`python -m`) or a script, given the request path, then `args`."""

    module: str | None = None
    script: str | None = None
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.module is None) == (self.script is None):
            raise ValueError("a worker entry is a module or a script, exactly one of them")
        if self.module is not None and not _MODULE_RE.fullmatch(self.module):
            raise ValueError(f"worker module {shown(self.module)} is not a dotted Python module name")

    def words(self, request_path: str) -> list[str]:
        """torchrun's trailing words: `-m MODULE` or `SCRIPT`, the request path, the extra arguments."""
        head = ["-m", self.module] if self.module is not None else [str(self.script)]
        return [*head, request_path, *self.args]


@dataclass(frozen=True)
class LaunchOutcome:
    """A job that ended successfully: rank 0's result and where its logs and files were put here."""

    launcher: str  # "torchrun" | "slurm"
    launch_id: str
    nodes: tuple[str, ...]  # node names as configured (torchrun) or as Slurm allocated them
    result: dict[str, Any]
    result_path: Path
    out_dir: Path
    seconds: float  # from the first connection to the result being here
    start_s: float  # until every agent had started (torchrun) or the job was running (Slurm)
    rendezvous: str | None = None  # HOST:PORT of the c10d rendezvous, when the launcher chose it
    job_id: str | None = None  # Slurm's job id
    logs: dict[str, Path] = field(default_factory=dict)  # name -> log file here


def new_launch_id() -> str:
    """A fresh id for one job: its rendezvous id and the tag its processes carry in the environment."""
    return f"axrl-{secrets.token_hex(6)}"


def check_launch_id(launch_id: str) -> str:
    """`launch_id` if it has the shape `new_launch_id` gives (it is put in shell text and process searches)."""
    if not isinstance(launch_id, str) or not _LAUNCH_ID_RE.fullmatch(launch_id):
        raise ValueError(f"launch id {shown(launch_id)} is not one this tool made (axrl-<12 hex digits>)")
    return launch_id


def request_document(launch_id: str, result_path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The request file's content: which job, where rank 0 writes its result, and the worker's own payload."""
    return {
        "format": REQUEST_FORMAT,
        "version": REQUEST_VERSION,
        "launch_id": launch_id,
        "result_path": result_path,
        "payload": dict(payload),
    }


def check_node_ready(report: NodeReport, node: str, *, python: str, where: str = "node") -> None:
    """Refuse a node whose Python cannot run the job (no interpreter, no torch, no package), saying what to do."""
    problems: list[str] = []
    if report.python_version is None:
        detail = "; ".join(note for note in report.notes if "did not run" in note) or "no output"
        problems.append(f"{python} did not run there ({detail[-300:]}); set `python:` of the target to a working one")
    else:
        if report.torch_version is None:
            problems.append(
                f"torch is not importable with {python}; install torch in that environment or point `python:` "
                "(and `setup:` lines) of the target at one that has it"
            )
        if not report.package_importable:
            problems.append(
                f"axrl_spike_replay is not importable with {python}; run `axrl-spike-replay node TARGET --install`"
            )
    if problems:
        host = f" ({report.hostname})" if report.hostname else ""
        raise LaunchError(f"{where} {node!r}{host} cannot run the job: " + "; ".join(problems), node=node)


def read_result(path: Path, where: str) -> dict[str, Any]:
    """Rank 0's result file, brought here after the job succeeded: a bounded JSON object."""
    try:
        doc = parse_untrusted_json(read_bounded(path, MAX_RESULT_BYTES, follow_symlinks=False), max_depth=64)
    except (OSError, UntrustedInputError) as exc:
        raise LaunchError(f"the job's result from {where} is not usable: {exc}") from None
    if not isinstance(doc, dict):
        raise LaunchError(f"the job's result from {where} is not a JSON object")
    return doc


def tail_text(path: Path, lines: int = 12, limit: int = 2000) -> str:
    """The last lines of a log file here, on one line for error messages (empty when there is none)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [
        clean_text(line.strip())
        for line in text.splitlines()
        if line.strip().strip("=-") and not line.startswith("@@axrl")  # no rulers, no marks of ours
    ]
    joined = " | ".join(kept[-lines:])
    return joined if len(joined) <= limit else "…" + joined[-limit:]


def shared_files_script(files: Mapping[str, int]) -> str:
    """A POSIX sh script printing, for each of `files` (by its index), its size on the node or why it has none."""
    lines = []
    for index, path in enumerate(files):
        quoted = shlex.quote(path)
        lines.append(
            f'if _s=$(stat -L -c %s -- {quoted} 2>&1); then echo "{FILE_MARK} {index} $_s"; '
            f'else echo "{FILE_MARK} {index} missing $_s"; fi'
        )
    return "\n".join(lines) + "\n"


def shared_files_problems(output: str, files: Mapping[str, int]) -> list[str]:
    """What a node's `shared_files_script` output says is wrong: a file it does not see, or sees at another size."""
    paths = list(files)
    seen: dict[int, str] = {}
    for line in output.splitlines():
        words = line.split(maxsplit=2)
        if words[:1] == [FILE_MARK] and len(words) == 3 and words[1].isdigit():
            seen[int(words[1])] = words[2]
    problems = []
    for index, path in enumerate(paths):
        said = seen.get(index)
        if said is None:
            problems.append(f"{path}: could not be checked there")
        elif said.startswith("missing"):
            why = said.removeprefix("missing").strip().rsplit(": ", 1)[-1] or "not found"
            problems.append(f"{path}: {clean_text(why)}")
        elif not said.strip().isdigit() or int(said) != files[path]:
            problems.append(f"{path}: {clean_text(said.strip())} bytes there, {files[path]} here")
    return problems


def shared_files_error(node: str, host: str | None, problems: list[str], where: str = "node") -> LaunchError:
    """The error for a node that does not see the job's shared files as this machine does."""
    at = f" ({host})" if host else ""
    return LaunchError(
        f"{where} {node!r}{at} does not see the snapshot as this machine does: {'; '.join(problems)}. Every node "
        "must read the snapshot at the same path (shared storage mounted there, the same files)",
        node=node,
    )
