"""The training log at a snapshot's iteration, as `diagnose` reads it: `snapshot.log_point` does the reading
(it sits below `inspect` and the replay engine, which check a snapshot against its log too)."""

from __future__ import annotations

from axrl_spike_replay.snapshot.log_point import AUTO_LOG_BYTES, NEIGHBOURHOOD, LogPoint, as_json, job_logs, log_point

__all__ = ["AUTO_LOG_BYTES", "NEIGHBOURHOOD", "LogPoint", "as_json", "job_logs", "log_point"]
