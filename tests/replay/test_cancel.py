"""Stopping a replay: a cancelled run stops its rank processes and leaves a failed result, not a half one."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.processes.rank_processes import RunCancelled, check_cancel


def test_cancelling_a_full_fidelity_replay_stops_its_processes(spike_snapshot: Path, tmp_path: Path) -> None:
    cancel = threading.Event()
    outcome: dict[str, BaseException] = {}
    before = {child.pid for child in multiprocessing.active_children()}  # the session's warm pools, if up

    def started() -> set[int]:
        return {child.pid for child in multiprocessing.active_children()} - before

    def replay() -> None:
        try:
            run_request(replay_request(What(spike_snapshot), workspace=tmp_path, job="cancel-me", cancel=cancel))
        except BaseException as exc:  # the assertion below says what was expected
            outcome["error"] = exc

    worker = threading.Thread(target=replay)
    worker.start()
    deadline = time.monotonic() + 60
    while not started() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started(), "the replay never started its rank processes"
    cancel.set()
    worker.join(timeout=60)

    assert not worker.is_alive()
    assert isinstance(outcome.get("error"), AxrlError)
    assert "cancelled" in str(outcome["error"])
    assert not started()
    results = list(tmp_path.glob("tmp/spike-replay/cancel-me/*/replay_result.json"))
    assert len(results) == 1
    doc = json.loads(results[0].read_text())
    assert doc["verdict"] == "failed" and doc["grad_norm"] is None
    assert "cancelled" in doc["error"]


def test_an_unset_cancel_event_does_not_stop_anything() -> None:
    check_cancel(None)
    check_cancel(threading.Event())
    event = threading.Event()
    event.set()
    with pytest.raises(RunCancelled, match="replay cancelled"):
        check_cancel(event, "replay")


def test_a_cancelled_attribution_stops_before_its_gradient_pass(spike_snapshot: Path) -> None:
    from axrl_spike_replay.investigation.request import What, replay_request
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike
    from axrl_spike_replay.vocabulary import Verb

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RunCancelled, match="attribution cancelled"):
        attribute_spike(replay_request(What(spike_snapshot, verb=Verb.ATTRIBUTE), cancel=cancel))


def test_a_cancelled_log_scan_stops_between_files(tmp_path: Path) -> None:
    from axrl_spike_replay.diagnosis.evidence.log_scan import scan_logs

    log = tmp_path / "train.log"
    log.write_text(" iteration        1/      10 | lm loss: 1.0E-01 | grad norm: 0.5 |\n")
    seen: list[str] = []
    assert len(scan_logs([log], tmp_path / "copy", progress=seen.append).series_points) == 1
    assert seen == ["scanning train.log (1/1)"]
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(AxrlError, match="cancelled"):
        scan_logs([log], tmp_path / "copy2", cancel=cancel)
