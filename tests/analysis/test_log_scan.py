"""An engineer copies a job's logs into the workspace and scans them for the grad-norm series, spikes and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.diagnosis.evidence.log_scan import error_kind, parse_line, scan_logs
from axrl_spike_replay.errors import AxrlError


def test_golden_training_log_shows_the_spikes_the_guard_saw(
    golden_output_dir: Path, tmp_path: Path, cli, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run = cli("logs", golden_output_dir, "--json")
    assert run.code == 0
    doc = run.json()
    copy = tmp_path / "tmp" / "spike-replay" / "fixture-moe" / "logs" / golden_output_dir.name / "logs" / "train.log"
    assert doc["copied"] == [str(copy)]
    assert copy.read_bytes() == (golden_output_dir / "logs" / "train.log").read_bytes()
    text = copy.read_text().splitlines()
    logged = [
        int(line.split("/")[0].split()[-1])
        for line in text
        if line.lstrip().startswith("iteration ") and "grad norm" in line
    ]
    assert [p["iteration"] for p in doc["series_points"]] == logged
    assert all(p["grad_norm"] > 0 and p["loss"] > 0 for p in doc["series_points"])
    # with the run's own detector settings (from its snapshots' run_config.yaml), the scan finds exactly
    # the spikes the guard tripped on during training, at the same ratios
    guard = [line.split() for line in text if line.startswith("[spike guard] iteration")]
    assert doc["detector"]["source"].endswith("run_config.yaml")
    assert [s["iteration"] for s in doc["spikes"]] == [int(g[3].rstrip(":")) for g in guard] != []
    for spike, g in zip(doc["spikes"], guard, strict=True):
        assert spike["spike_ratio"] == pytest.approx(float(g[8].rstrip("x")), abs=0.01)
    assert doc["errors"] == []  # "number of nan iterations: 0" is not an error


def test_key_value_logs_with_a_spike_and_errors(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    lines = [
        f"2025-01-01 12:00:{i % 60:02d} INFO step={i} grad_norm={1.0 + 0.01 * (i % 3)} loss=0.5" for i in range(1, 40)
    ]
    lines[29] = "2025-01-01 12:00:30 INFO step=30 grad_norm=12.5 loss=3.0"
    lines += [
        "step:40 - actor/grad_norm:1.02 - actor/pg_loss:0.4",
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "RuntimeError: CUDA out of memory",
        "[rank1] ERROR watchdog caught collective timeout",
        "step=41 grad_norm=nan loss=nan",
    ]
    log.write_text("\n".join(lines) + "\n")

    scan = scan_logs([log], tmp_path / "copies")

    assert scan.copied == [str(tmp_path / "copies" / "worker.log")]
    assert [p["iteration"] for p in scan.series_points] == list(range(1, 42))
    assert scan.series_points[39] == {"iteration": 40, "grad_norm": 1.02, "loss": 0.4}
    assert [(s["iteration"], round(s["spike_ratio"], 1)) for s in scan.spikes][:1] == [(30, 12.4)]
    assert [s["iteration"] for s in scan.spikes] == [30, 41]  # a NaN norm always trips
    assert [e["kind"] for e in scan.errors] == ["traceback", "exception", "error", "non_finite"]
    assert scan.errors[1]["line"] == 43 and scan.detector["source"] == "defaults"


def test_megatron_and_key_value_parsing() -> None:
    megatron = (
        " iteration      120/   10000 | consumed samples: 30720 | elapsed time per iteration (ms): 1234.5 | "
        "learning rate: 1.0E-06 | lm loss: 1.234567E+00 | loss scale: 1.0 | grad norm: 45.678 | "
        "number of skipped iterations: 0 | number of nan iterations: 0 |"
    )
    assert parse_line(megatron) == (120, 45.678, 1.234567)
    assert parse_line("iteration=7 global_grad_norm=2.5e+01") == (7, 25.0, None)
    assert parse_line("[spike guard] iteration 7: grad norm 2.96 is 5.37x the rolling median") is None
    assert parse_line("loss=0.3 without a step") is None
    assert error_kind("INFO all good") is None and error_kind("loss: inf") == "non_finite"


def test_large_logs_stream_and_repeated_iterations_keep_the_last(tmp_path: Path) -> None:
    first, restart = tmp_path / "a.log", tmp_path / "b.log"
    with first.open("w") as handle:
        for i in range(1, 50_001):
            handle.write(f"step={i} grad_norm=1.0 loss=0.1 " + "x" * 80 + "\n")
    restart.write_text("step=50000 grad_norm=2.0 loss=0.2\n")  # the run restarted and re-logged a step
    scan = scan_logs([first, restart], tmp_path / "copies")
    assert scan.lines == 50_001 and len(scan.series_points) == 50_000
    assert scan.series_points[-1]["grad_norm"] == 2.0 and scan.repeated_iterations == 1


def test_missing_paths_are_clear_errors(tmp_path: Path, cli) -> None:
    with pytest.raises(AxrlError, match="log file or directory not found"):
        scan_logs([tmp_path / "nope.log"])
    (tmp_path / "empty").mkdir()
    run = cli("logs", tmp_path / "empty", "--dest", tmp_path / "out")
    assert run.code == 2 and "no *.log files" in run.err and "Traceback" not in run.err


def test_a_spike_in_the_warm_up_part_of_a_log_is_flagged_as_the_guard_flags_it(tmp_path: Path, cli) -> None:
    """The log scan runs the guard's detector, armed from step 1: a step at 35x the first steps' median inside the
    warm-up is a spike (`warm_up: true`); `--warmup-ratio off` scans with the blind warm-up the guard used to have."""
    log = tmp_path / "train.log"
    norms = [1.0, 1.1, 0.9, 35.0, 1.0, 1.05, 0.95, 1.0, 1.02, 0.98, 1.0, 1.01, 0.99, 40.0, 1.0]
    log.write_text("".join(f"step={i} grad_norm={g} loss=0.5\n" for i, g in enumerate(norms, start=1)))
    run = cli("logs", log, "--dest", tmp_path / "armed", "--json")
    assert run.code == 0, run.err
    spikes = run.json()["spikes"]
    assert [(s["iteration"], s["warm_up"], s["rule"]) for s in spikes] == [
        (4, True, "warmup_ratio"),
        (14, False, "detector"),
    ]
    assert spikes[0]["spike_ratio"] == pytest.approx(35.0 / 1.0)
    assert run.json()["detector"]["warmup_ratio"] == 10.0
    blind = cli("logs", log, "--dest", tmp_path / "blind", "--warmup-ratio", "off", "--json")
    assert [s["iteration"] for s in blind.json()["spikes"]] == [14]
    bad = cli("logs", log, "--dest", tmp_path / "bad", "--warmup-ratio", "often")
    assert bad.code == 2 and "warmup-ratio" in bad.err and "often" in bad.err
