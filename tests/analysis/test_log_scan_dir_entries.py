"""A logs dir is someone else's tree: one with thousands of files is listed in work linear in their number, and a
FIFO (given, or named *.log in a dir) is refused as what it is, never opened in a way that waits for a writer."""

from __future__ import annotations

import os
import pathlib
import threading
from pathlib import Path

import pytest

from axrl_spike_replay.diagnosis.evidence.log_scan import scan_logs
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.logs.log_reader import LogTally, scan_file
from axrl_spike_replay.snapshot.discovery import split_logs

GUARD_S = 60.0  # a hang guard for a read that must not wait, never a measured time


def output_dir_with_logs(tmp_path: Path, count: int) -> Path:
    out = tmp_path / "run1~job__actor"
    (out / "logs" / "ranks").mkdir(parents=True)
    (out / "train.log").write_text("iteration 1/ 100 | grad norm: 1.5 | loss: 1.0 |\n")
    for index in range(count):
        (out / "logs" / "ranks" / f"r{index:05d}.log").write_text(
            f"iteration {index + 2}/ 100 | grad norm: 1.0 | loss: 1.0 |\n"
        )
    return out


def test_listing_a_logs_dir_compares_each_file_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted, not timed: checking each file against a list of the others made 16k files take 36 s."""
    out = output_dir_with_logs(tmp_path, 2000)
    comparisons = 0
    equal = pathlib.PurePath.__eq__

    def counted(self: pathlib.PurePath, other: object) -> bool:
        nonlocal comparisons
        comparisons += 1
        return equal(self, other)

    monkeypatch.setattr(pathlib.PurePath, "__eq__", counted)
    inside, leaving = split_logs(out)
    monkeypatch.undo()
    assert len(inside) == 2001 and leaving == []
    assert comparisons < 40 * len(inside), comparisons  # a path's own parents, not every other path


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_fifo_given_as_a_log_is_refused_as_a_fifo(tmp_path: Path) -> None:
    pipe = fifo(tmp_path / "train.log")
    with pytest.raises(AxrlError, match=r"train\.log: is a FIFO \(named pipe\), not a log file or directory"):
        scan_logs([pipe], tmp_path / "copies")


def test_a_fifo_named_like_a_log_in_a_dir_is_skipped_with_why_and_the_rest_is_read(tmp_path: Path) -> None:
    out = output_dir_with_logs(tmp_path, 2)
    pipe = fifo(out / "logs" / "stuck.log")
    scan = scan_logs([out], tmp_path / "copies")
    assert {"path": str(pipe), "reason": "is a FIFO (named pipe), not a log file; not read"} in scan.skipped
    assert len(scan.copied) == 3 and [p["iteration"] for p in scan.series_points] == [1, 2, 3]


def test_reading_a_fifo_never_waits_for_a_writer(tmp_path: Path) -> None:
    """A FIFO put where a log was listed (the check and the open are apart in time) is refused at open."""
    pipe = fifo(tmp_path / "swapped.log")
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            scan_file(pipe, LogTally())
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(GUARD_S)
    if reader.is_alive():  # blocked in open(): let it go with a writer's open and close, then fail
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(GUARD_S)
        pytest.fail("opening a FIFO waited for a writer")
    assert isinstance(outcome[0], AxrlError) and "is a FIFO (named pipe), not a regular file" in str(outcome[0])
