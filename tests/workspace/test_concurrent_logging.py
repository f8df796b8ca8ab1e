"""Several replays finish at once and log into the same task: every row is kept, ids stay unique."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from record_helpers import JOB, replay_result

from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.task_record.task_log import record_failure, record_replay
from axrl_spike_replay.workspace.task_record.task_state import show_task

WRITERS = 4
ROWS_EACH = 6


def _log_rows(workspace: str, writer: int, start: object) -> None:
    """One replay process: wait for the others, then log its rows (and one failure) as fast as it can."""
    start.wait()
    for i in range(ROWS_EACH):
        result = replay_result(Path("/snapshots/iter_0000005"), 10.0 + writer + i / 10, "no_effect",
                               mitigations={"advantage_clip": writer * 100 + i})  # fmt: skip
        record_replay(Path(workspace), JOB, result, Path(workspace) / f"w{writer}-{i}.json")
    record_failure(Path(workspace), JOB, reason=f"writer {writer} node unreachable", command="replay", snapshot="s")


def test_concurrent_writers_lose_no_row(tmp_path: Path) -> None:
    open_task(tmp_path, JOB)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_log_rows, args=(str(tmp_path), w, start)) for w in range(WRITERS)]
    for proc in procs:
        proc.start()
    start.set()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0

    task = show_task(tmp_path, JOB)
    rows = task.experiments
    assert len(rows) == WRITERS * ROWS_EACH
    assert [row.id for row in rows] == [f"E{i}" for i in range(1, WRITERS * ROWS_EACH + 1)]
    logged = sorted(row.mitigations["advantage_clip"] for row in rows)
    assert logged == sorted(w * 100 + i for w in range(WRITERS) for i in range(ROWS_EACH))
    assert sorted(f["reason"] for f in task.failed) == [f"writer {w} node unreachable" for w in range(WRITERS)]
    # The markdown beside it was rendered from the final state: every row is there too.
    md = Path(task.task_file).read_text()
    assert all(f"| {row.id} |" in md for row in rows)
    assert json.loads(Path(task.state_file).read_text())["experiments"] == [row.to_json() for row in rows]
