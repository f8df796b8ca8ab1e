"""Where a run's files go in the workspace, and its entry in the investigation's task file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.experiment.run_dir import RunDir
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.workspace.paths import check_workspace, job_tmp_dir
from axrl_spike_replay.workspace.task_log import record_failure, record_replay


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

    def open_run(self, job: str) -> RunDir:
        return new_run_dir(self.workspace, job)

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


def recorder_for(workspace: str | Path | None) -> WorkspaceRecorder | None:
    """The recorder of a workspace; None (nothing written) without one."""
    return WorkspaceRecorder(Path(workspace)) if workspace is not None else None
