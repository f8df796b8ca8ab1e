"""A snapshot in its job output dir is checked against the job's training log: the logged grad norm and loss at
its iteration and the norms just before, read by the same line reader as `logs`."""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.log_point import job_logs, log_point


def _job_dir(tmp_path: Path, lines: list[str]) -> Path:
    out = tmp_path / "run~job__actor"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "train.log").write_text("\n".join(lines) + "\n")
    snapshot = out / SNAPSHOTS_DIR / "iter_0000012"
    snapshot.mkdir(parents=True)
    return snapshot


def test_the_logged_norm_loss_and_neighbourhood_at_the_snapshot_iteration(tmp_path: Path) -> None:
    lines = [f"step={i} grad_norm={0.5 + 0.01 * i} loss={1.0 - 0.01 * i}" for i in range(1, 12)]
    lines += ["step=12 grad_norm=9.5 loss=0.7", "step=11 grad_norm=0.66 loss=0.9", "RuntimeError: boom"]
    snapshot = _job_dir(tmp_path, lines)
    assert [p.name for p in job_logs(snapshot)] == ["train.log"]
    point = log_point(snapshot, 12)
    assert point.grad_norm == 9.5 and point.loss == 0.7
    assert len(point.before) == 10 and point.before[-1] == 0.66  # iteration 11 logged twice: the last one wins
    assert point.error_lines == 1 and point.source and point.source.endswith("train.log")


def test_an_iteration_the_log_lacks_and_a_snapshot_outside_a_job_dir_say_why(tmp_path: Path) -> None:
    snapshot = _job_dir(tmp_path, ["step=3 grad_norm=1.0 loss=1.0"])
    assert log_point(snapshot, 12).note == "the logs have no grad norm at iteration 12"
    loose = tmp_path / "loose" / "iter_0000012"
    loose.mkdir(parents=True)
    assert job_logs(loose) == [] and "no job logs known" in log_point(loose, 12).note
