"""Method files label their figures by what they are: the rel diff vs recorded is the baseline's fidelity check
(a mitigated replay moves the norm on purpose), and a clear threshold the user gave is not the detector's."""

from __future__ import annotations

from pathlib import Path

from record_helpers import JOB, RECORDED, THRESHOLD, SpikeRun, replay_result, save_result

from axrl_spike_replay.experiment.verdict import threshold_label, verdict_basis
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.method_files.methods import add_method
from axrl_spike_replay.workspace.task_record.task_log import record_replay

BASE = 37.4189
MEDIAN = 2.91


def _method(workspace: Path, snapshot: Path, grad_norm: float, threshold: float, source: str, verdict: str) -> str:
    """The method file of a replay judged against `threshold` from `source`; its text."""
    open_task(workspace, JOB, str(snapshot), diagnosis="off")
    base = replay_result(snapshot, BASE, "reproduced")
    record_replay(workspace, JOB, base, save_result(workspace, "base", base))
    detector = THRESHOLD if source == "clear_threshold" else None
    mitigated = replay_result(
        snapshot, grad_norm, verdict, mitigations={"advantage_clip": 1.0}, baseline_grad_norm=BASE,
        change_vs_baseline=grad_norm / BASE - 1, threshold=threshold,
        verdict_basis=verdict_basis(grad_norm, BASE, MEDIAN, threshold, source, detector),
    )  # fmt: skip
    attempt = record_replay(workspace, JOB, mitigated, save_result(workspace, "clip", mitigated))
    assert attempt is not None
    return Path(add_method(workspace, JOB, attempt, "clip-1", "clamps the advantages").path).read_text()


def test_the_mitigated_side_has_no_rel_diff_vs_recorded(tmp_path: Path, spike_run: SpikeRun) -> None:
    text = _method(tmp_path, spike_run.snapshot, 3.812, THRESHOLD, "detector", "cleared")
    assert f"| rel diff vs recorded | {abs(BASE - RECORDED) / RECORDED:.4g} | — |" in text
    assert f"{abs(3.812 - RECORDED) / RECORDED:.4g}" not in text  # the mitigated norm's distance from the record
    assert "median 2.91,\ndetector threshold 5;" in text
    assert "is below the detector threshold 5" in text


def test_a_users_clear_threshold_is_not_called_the_detector_threshold(tmp_path: Path, spike_run: SpikeRun) -> None:
    text = _method(tmp_path, spike_run.snapshot, 7.0, 2.0, "clear_threshold", "partial")  # ratio 2.405: not under 2
    assert "detector threshold" not in text
    assert "median 2.91,\nclear threshold given for the replay 2;" in text
    assert (
        "residual spike: ratio to median 2.405 is still at or above the clear threshold given for the replay 2" in text
    )


def test_the_threshold_label_follows_the_verdict_basis() -> None:
    assert threshold_label({"threshold_source": "detector"}) == "detector threshold"
    assert threshold_label({"threshold_source": "clear_threshold"}) == "clear threshold given for the replay"
    assert threshold_label({"threshold_source": "default"}).startswith("default ratio threshold")
    assert threshold_label(None) == "threshold"  # a result rebuilt from a task row does not say
