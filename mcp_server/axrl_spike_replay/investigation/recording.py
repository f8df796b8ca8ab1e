"""Where a run's files go in the workspace, and its entry in the investigation's task file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.experiment.run_dir import RunDir
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.workspace.paths import check_workspace, job_tmp_dir, task_md_path
from axrl_spike_replay.workspace.task_record.task_log import record_failure, record_replay
from axrl_spike_replay.workspace.task_record.task_state import task_exists


def new_run_dir(workspace: str | Path | None, job: str) -> RunDir:
    """A new `<workspace>/tmp/spike-replay/<job>/<timestamp>/`; a RunDir writing nothing without a workspace."""
    if workspace is None:
        return RunDir(None)
    return RunDir.new_in(job_tmp_dir(check_workspace(workspace), check_plain_name(job, "job name")))


@dataclass(frozen=True)
class WorkspaceRecorder:
    """Runs write under the workspace's `tmp/spike-replay/` and are logged in the job's task file when one is open."""

    workspace: Path
    target: str = "local"
    progress: Callable[[str], None] | None = field(default=None, compare=False)  # told where the run is recorded

    def open_run(self, job: str) -> RunDir:
        run = new_run_dir(self.workspace, job)
        if self.progress is not None and run.path is not None:
            self.progress(where_recorded(self.workspace, job, run.path))
        return run

    def replayed(self, job: str, result: ReplayResult, path: Path) -> str | None:
        return record_replay(self.workspace, job, result, path)

    def failed(self, job: str, *, reason: str, command: str, snapshot: str, result_path: Path | None) -> str | None:
        return record_failure(
            self.workspace,
            job,
            reason=reason,
            command=command,
            snapshot=snapshot,
            target=self.target,
            result_path=result_path,
        )


def recorder_for(
    workspace: str | Path | None, progress: Callable[[str], None] | None = None
) -> WorkspaceRecorder | None:
    """The recorder of a workspace (saying where each run goes through `progress`); None (nothing written) without
    one."""
    return WorkspaceRecorder(Path(workspace), progress=progress) if workspace is not None else None


def where_recorded(workspace: Path, job: str, run_dir: Path) -> str:
    """One line for people: the workspace a run writes into (its output dir), and whether the job's task there logs
    it. The workspace defaults to the current directory, so a command run from elsewhere says so here."""
    root = check_workspace(workspace)
    head = f"workspace {root}: output in {run_dir}"
    if task_exists(root, job):
        return f"{head}; logged in the task file {task_md_path(root, job)}"
    return (
        f"{head}; no task is open for job {job} there, so the run is not logged in a task file "
        f"(`axrl-spike-replay task open {job} --workspace {root}` opens one)"
    )
